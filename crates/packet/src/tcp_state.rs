//! TCP connection states as IPVS tracks them (`tcp_states` in
//! `net/netfilter/ipvs/ip_vs_proto_tcp.c`).
//!
//! A load balancer sees a TCP connection from the middle, so its "state" is
//! a guess at both ends' states, good enough to pick a timeout. IPVS keeps
//! one table per direction:
//!
//! * [`TcpDir::Input`] — client → backend packets of a flow whose replies
//!   weir also sees (nat, fnat);
//! * [`TcpDir::Output`] — the backend's replies (nat, fnat);
//! * [`TcpDir::InputOnly`] — client → backend packets of a flow whose
//!   replies bypass weir (dr).
//!
//! Only one flag counts per packet, in the precedence RST > SYN > FIN > ACK;
//! a packet with none of them leaves the state unchanged. [`next`] is the
//! whole machine: a pure function with the table below (IPVS's, minus its
//! LISTEN and SYNACK columns, which no transition of the normal table
//! enters). As in current kernels, an ACK from NONE in an input direction
//! goes to CLOSE (an ACK cannot open a flow; `sloppy_tcp` is the caller's
//! choice before a flow exists), while the output table's ACK from NONE goes
//! to ESTABLISHED.

use weir_flowtable::FlowState;

use crate::parse::TcpFlags;
use crate::rewrite::{Direction, Method};

/// The states of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TcpState {
    /// No packet seen yet.
    None,
    /// ESTABLISHED.
    Established,
    /// SYN_SENT (a SYN seen in the output direction).
    SynSent,
    /// SYN_RECV (the client's SYN seen).
    SynRecv,
    /// FIN_WAIT.
    FinWait,
    /// TIME_WAIT.
    TimeWait,
    /// CLOSE.
    Close,
    /// CLOSE_WAIT.
    CloseWait,
    /// LAST_ACK.
    LastAck,
}

/// Which table applies to a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TcpDir {
    /// Client → backend, replies seen too (nat, fnat).
    Input,
    /// Backend → client (nat, fnat).
    Output,
    /// Client → backend, replies never seen (dr).
    InputOnly,
}

impl TcpDir {
    /// The table for a packet of a flow forwarded with `method` travelling
    /// `direction`: `dr` sees only its input.
    pub fn of(method: Method, direction: Direction) -> TcpDir {
        match (method, direction) {
            (Method::Dr, _) => TcpDir::InputOnly,
            (_, Direction::ToBackend) => TcpDir::Input,
            (_, Direction::ToClient) => TcpDir::Output,
        }
    }
}

/// The flag class of a packet, by precedence RST > SYN > FIN > ACK; `None`
/// when none is set (the state does not change).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlagClass {
    /// SYN (row 0 of each table).
    Syn,
    /// FIN (row 1).
    Fin,
    /// ACK (row 2).
    Ack,
    /// RST (row 3).
    Rst,
}

impl FlagClass {
    /// Classifies a flags byte.
    pub fn of(flags: TcpFlags) -> Option<FlagClass> {
        if flags.has(TcpFlags::RST) {
            Some(FlagClass::Rst)
        } else if flags.has(TcpFlags::SYN) {
            Some(FlagClass::Syn)
        } else if flags.has(TcpFlags::FIN) {
            Some(FlagClass::Fin)
        } else if flags.has(TcpFlags::ACK) {
            Some(FlagClass::Ack)
        } else {
            None
        }
    }
}

use TcpState::{
    Close as CL, CloseWait as CW, Established as ES, FinWait as FW, LastAck as LA, None as NO,
    SynRecv as SR, SynSent as SS, TimeWait as TW,
};

/// `TABLE[dir][flag class][state]`, columns in [`TcpState`] order:
/// NO ES SS SR FW TW CL CW LA.
const TABLE: [[[TcpState; 9]; 4]; 3] = [
    // Input
    [
        /* syn */ [SR, ES, ES, SR, SR, SR, SR, SR, SR],
        /* fin */ [CL, CW, SS, TW, TW, TW, CL, CW, LA],
        /* ack */ [CL, ES, SS, ES, FW, TW, CL, CW, CL],
        /* rst */ [CL, CL, CL, SR, CL, CL, CL, CL, LA],
    ],
    // Output
    [
        /* syn */ [SS, ES, SS, SR, SS, SS, SS, SS, SS],
        /* fin */ [TW, FW, SS, TW, FW, TW, CL, TW, LA],
        /* ack */ [ES, ES, SS, ES, FW, TW, CL, CW, LA],
        /* rst */ [CL, CL, SS, CL, CL, TW, CL, CL, CL],
    ],
    // Input only
    [
        /* syn */ [SR, ES, ES, SR, SR, SR, SR, SR, SR],
        /* fin */ [CL, FW, SS, TW, FW, TW, CL, CW, LA],
        /* ack */ [CL, ES, SS, ES, FW, TW, CL, CW, CL],
        /* rst */ [CL, CL, CL, SR, CL, CL, CL, CL, LA],
    ],
];

/// The state after a packet with `flags` travelling `dir` in a flow in
/// `state`.
pub fn next(state: TcpState, dir: TcpDir, flags: TcpFlags) -> TcpState {
    let Some(class) = FlagClass::of(flags) else {
        return state;
    };
    let d = match dir {
        TcpDir::Input => 0,
        TcpDir::Output => 1,
        TcpDir::InputOnly => 2,
    };
    let f = match class {
        FlagClass::Syn => 0,
        FlagClass::Fin => 1,
        FlagClass::Ack => 2,
        FlagClass::Rst => 3,
    };
    TABLE[d][f][state as usize]
}

/// How far a RST's sequence number may lie from where its sender is known
/// to be, and how far one segment may move that place forward: 1 MiB.
///
/// Why: IPVS moves a flow to CLOSE on any RST (row 3 above), so a blind
/// attacker who guesses a client's address and port ends an established
/// flow with one spoofed packet; its 10 s CLOSE timeout then drops an idle
/// connection's next packet. conntrack, and the endpoints themselves
/// (RFC 5961 3.2), take a RST only within the receive window. weir sees
/// every segment each sender sends through it, so it keeps per direction
/// the sequence number just past the last one (4 bytes each way in the
/// entry) and takes a RST as a state change only near it. A segment moves
/// that place forward by at most this much, or a spoofed segment far ahead
/// would set it to a number the attacker knows. A blind attacker now needs
/// ~2^32 / 2^21 = 2,048 guesses per flow for either. The RST itself is
/// still forwarded: the endpoint applies its own check.
///
/// What it costs a real flow: a RST that lags its sender by more than
/// 1 MiB (one sent by a host that lost the connection, quoting an
/// acknowledgement that old) or a gap of over 1 MiB between two segments
/// weir sees (a burst lost before weir) leaves the flow in its state until
/// its timeout instead of CLOSE's: the entry lingers; no packet is lost.
pub const SEQ_WINDOW: u32 = 1 << 20;

/// Whether a RST with sequence number `seq` may change the state of a flow
/// whose sender in that direction was last noted at `known` (0: nothing
/// noted, so nothing to check against).
pub fn rst_acceptable(seq: u32, known: u32) -> bool {
    known == 0
        || known == AWAIT_SYN
        || seq.wrapping_sub(known).wrapping_add(SEQ_WINDOW) <= 2 * SEQ_WINDOW
}

/// A place that waits for its sender's SYN: the client started a new
/// connection ([`opens_connection`]: a new flow, or a port reused on a
/// closing one), so the backend's place is none yet or the old
/// connection's, and its next SYN-ACK starts it afresh; until
/// then only a SYN is noted, and nothing is checked against it (as with
/// nothing noted). No segment is noted as 1 ([`seq_to_note`] notes 2 for
/// one ending at 0 or 1).
///
/// Why: the backend may answer the new SYN for its old connection first
/// (a challenge ACK from its TIME_WAIT socket, which moves the flow to
/// ESTABLISHED by IPVS's table), so by the time its SYN-ACK comes the
/// flow is established and a SYN there notes nothing. Without this, its
/// place stayed the old connection's, and the new connection's FIN and
/// RST from the backend were ignored (nat, `weir-bench packet --only tcp`:
/// one of each for ~6% of wrk's connections).
pub const AWAIT_SYN: u32 = 1;

/// Whether a client segment with `flags` that [`seq_to_note`] noted
/// `noted` opens a connection: its SYN on a new flow, or on a closing one
/// (a port reused). The backend's place is then set to [`AWAIT_SYN`].
///
/// Why a new flow too, not only a reused port: the backend may still hold
/// an earlier connection of the same addresses and ports (in TIME_WAIT,
/// from before weir's entry, or another path's), and answers the SYN with
/// a challenge ACK of that connection. Noted as the backend's place, it
/// left the place stale for the connection that follows, and moved the
/// flow to ESTABLISHED by IPVS's table (see [`rst_in_handshake`] for the
/// client's answer to it).
pub fn opens_connection(flags: TcpFlags, noted: Option<u32>) -> bool {
    flags.has(TcpFlags::SYN) && !flags.has(TcpFlags::ACK) && noted.is_some()
}

/// Whether a client RST that is not near the client's place may still
/// change the state of a flow whose replies weir sees (nat, fnat) and
/// whose backend's place is `backend`: yes while the backend has not
/// answered the client's SYN with its own ([`AWAIT_SYN`]), when no
/// connection is open to protect.
///
/// Why: a backend that holds an earlier connection of the same ports
/// answers a new SYN with a challenge ACK; the client answers that with a
/// RST whose sequence number is the ACK's acknowledgment number, the old
/// connection's, far from the client's new place. Ignored, it left the
/// flow ESTABLISHED (where the ACK had moved it) for 900 s unless the
/// client tried again (nat, `weir-bench packet --only tcp`: ~600-1,000
/// such RSTs per run, every one on a flow of three packets: SYN, ACK,
/// RST). conntrack accepts such a RST by remembering the ACK's number;
/// the node has no room for it, and with the backend yet to answer there
/// is nothing a blind RST could end but a handshake, which the client's
/// next SYN starts again.
pub fn rst_in_handshake(backend: u32) -> bool {
    backend == AWAIT_SYN
}

/// The sequence number to note for a segment with `flags` ending at `end`
/// (its sequence number plus SEG.LEN) in a flow in `state` (before the
/// segment moves it) whose sender was last noted at `known`, or `None` to
/// leave it. A RST notes nothing; a SYN starts afresh unless the flow is
/// established (a handshake's SYN and SYN-ACK, or a port reused with a new
/// initial sequence number while the old connection's entry is closing);
/// anything else moves forward by at most [`SEQ_WINDOW`].
///
/// Why any state but ESTABLISHED, not only TIME_WAIT and CLOSE: a port is
/// reused from whatever closing state weir last saw. dr sees only the
/// client, whose FIN leaves the flow in FIN_WAIT; in nat the backend's
/// SYN-ACK comes once the client's SYN moved the flow to SYN_RECV. Left
/// to the old connection's place, the new one's segments were all out of
/// the window, so its FIN and RST changed nothing and the entry stayed
/// ESTABLISHED for 900 s (`weir-bench packet --only tcp`, session 26:
/// thousands of `fin_ignored` per run of wrk, which reuses ports). In an
/// established flow a SYN notes nothing: a blind one must not move the
/// place to where its sender knows it is.
pub fn seq_to_note(state: TcpState, flags: TcpFlags, end: u32, known: u32) -> Option<u32> {
    if flags.has(TcpFlags::RST) {
        return None;
    }
    let syn = flags.has(TcpFlags::SYN);
    if known == AWAIT_SYN && !syn {
        return None;
    }
    let fresh = known == 0 || known == AWAIT_SYN || (syn && state != TcpState::Established);
    // 0 means "nothing noted" and 1 [`AWAIT_SYN`]: a segment ending at 0
    // or 1 is noted as 2, inside the window of the true value.
    if fresh {
        return Some(end.max(2));
    }
    let ahead = end.wrapping_sub(known);
    (ahead != 0 && ahead <= SEQ_WINDOW).then_some(end.max(2))
}

impl TcpState {
    /// The flow table's state for this one; `None` for [`TcpState::None`]
    /// (a flow is inserted with the state of its first packet).
    pub fn to_flow_state(self) -> Option<FlowState> {
        Some(match self {
            TcpState::None => return None,
            TcpState::Established => FlowState::Established,
            TcpState::SynSent => FlowState::SynSent,
            TcpState::SynRecv => FlowState::SynRecv,
            TcpState::FinWait => FlowState::FinWait,
            TcpState::TimeWait => FlowState::TimeWait,
            TcpState::Close => FlowState::Close,
            TcpState::CloseWait => FlowState::CloseWait,
            TcpState::LastAck => FlowState::LastAck,
        })
    }

    /// The state of a TCP flow stored in the table; `None` for the UDP and
    /// persistence-template states.
    pub fn from_flow_state(s: FlowState) -> Option<TcpState> {
        Some(match s {
            FlowState::SynSent => TcpState::SynSent,
            FlowState::SynRecv => TcpState::SynRecv,
            FlowState::Established => TcpState::Established,
            FlowState::FinWait => TcpState::FinWait,
            FlowState::CloseWait => TcpState::CloseWait,
            FlowState::LastAck => TcpState::LastAck,
            FlowState::TimeWait => TcpState::TimeWait,
            FlowState::Close => TcpState::Close,
            FlowState::Udp | FlowState::Persist => return None,
        })
    }

    /// All states, in table column order.
    pub const ALL: [TcpState; 9] = [NO, ES, SS, SR, FW, TW, CL, CW, LA];
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYN: TcpFlags = TcpFlags(TcpFlags::SYN);
    const SYNACK: TcpFlags = TcpFlags(TcpFlags::SYN | TcpFlags::ACK);
    const ACK: TcpFlags = TcpFlags(TcpFlags::ACK);
    const FINACK: TcpFlags = TcpFlags(TcpFlags::FIN | TcpFlags::ACK);
    const RST: TcpFlags = TcpFlags(TcpFlags::RST | TcpFlags::ACK);

    fn run(steps: &[(TcpDir, TcpFlags)]) -> Vec<TcpState> {
        let mut s = TcpState::None;
        steps
            .iter()
            .map(|&(d, f)| {
                s = next(s, d, f);
                s
            })
            .collect()
    }

    #[test]
    fn a_rst_counts_only_near_its_senders_place() {
        let w = SEQ_WINDOW;
        assert!(rst_acceptable(12345, 0), "nothing noted: nothing to check");
        for known in [2, 1000, 1 << 31, u32::MAX, w / 2] {
            for off in [0, 1, w] {
                assert!(
                    rst_acceptable(known.wrapping_add(off), known),
                    "{known} +{off}"
                );
                assert!(
                    rst_acceptable(known.wrapping_sub(off), known),
                    "{known} -{off}"
                );
            }
            for off in [w + 1, 1 << 24, 1 << 31] {
                assert!(
                    !rst_acceptable(known.wrapping_add(off), known),
                    "{known} +{off}"
                );
                assert!(
                    !rst_acceptable(known.wrapping_sub(off), known),
                    "{known} -{off}"
                );
            }
        }
    }

    #[test]
    fn the_noted_place_moves_forward_within_the_window_only() {
        use TcpState::{
            Close as CL, CloseWait as CW, Established as ES, FinWait as FW, LastAck as LA,
            SynRecv as SR, SynSent as SS, TimeWait as TW,
        };
        let w = SEQ_WINDOW;
        // First segment each way: noted whatever it is (0 stays "nothing").
        assert_eq!(seq_to_note(SR, SYN, 77, 0), Some(77));
        assert_eq!(seq_to_note(SR, SYN, 0, 0), Some(2));
        assert_eq!(seq_to_note(SR, SYN, 1, 0), Some(2));
        // Forward by up to the window, across the wrap too.
        assert_eq!(seq_to_note(ES, ACK, 1500, 100), Some(1500));
        assert_eq!(seq_to_note(ES, ACK, 100 + w, 100), Some(100 + w));
        assert_eq!(seq_to_note(ES, ACK, 10, u32::MAX - 10), Some(10));
        // Not back (a retransmission), not in place, not far ahead.
        assert_eq!(seq_to_note(ES, ACK, 50, 100), None);
        assert_eq!(seq_to_note(ES, ACK, 100, 100), None);
        assert_eq!(seq_to_note(ES, ACK, 101 + w, 100), None);
        assert_eq!(
            seq_to_note(ES, ACK, 100u32.wrapping_add(1 << 31), 100),
            None
        );
        // A RST notes nothing; a SYN starts afresh unless the flow is
        // established: a handshake (the SYN-ACK in SYN_RECV), a port reused
        // from any closing state; never in an open one.
        assert_eq!(seq_to_note(ES, RST, 200, 100), None);
        assert_eq!(seq_to_note(ES, SYN, 1 << 30, 100), None);
        assert_eq!(seq_to_note(ES, SYNACK, 1 << 30, 100), None);
        for st in [SR, TW, CL, FW, CW, LA, SS] {
            assert_eq!(seq_to_note(st, SYN, 1 << 30, 100), Some(1 << 30), "{st:?}");
        }
        assert_eq!(seq_to_note(SR, SYNACK, 1 << 30, 100), Some(1 << 30));
    }

    #[test]
    fn a_place_awaiting_a_syn_notes_only_a_syn_and_checks_nothing() {
        use TcpState::{Established as ES, SynRecv as SR};
        // Not an ACK (a challenge ACK of the old connection), not a FIN.
        assert_eq!(seq_to_note(ES, ACK, 5000, AWAIT_SYN), None);
        assert_eq!(seq_to_note(SR, FINACK, 5000, AWAIT_SYN), None);
        // The SYN-ACK, in whatever state the ACK left the flow.
        assert_eq!(seq_to_note(ES, SYNACK, 5000, AWAIT_SYN), Some(5000));
        assert_eq!(seq_to_note(SR, SYNACK, 5000, AWAIT_SYN), Some(5000));
        // Nothing to check a RST or FIN against meanwhile.
        assert!(rst_acceptable(1 << 31, AWAIT_SYN));
        // The client's SYN that noted its place opens a connection (a new
        // flow or a reused port); a SYN-ACK or a SYN that noted nothing
        // does not.
        assert!(opens_connection(SYN, Some(1 << 30)));
        assert!(!opens_connection(SYNACK, Some(1 << 30)));
        assert!(!opens_connection(SYN, None));
        assert!(!opens_connection(ACK, Some(200)));
        // Until the backend answers with its SYN, a client's RST is not
        // checked against the client's place (nat, fnat).
        assert!(rst_in_handshake(AWAIT_SYN));
        assert!(!rst_in_handshake(0) && !rst_in_handshake(5000));
    }

    #[test]
    fn nat_handshake_and_client_close() {
        use TcpDir::{Input as I, Output as O};
        let states = run(&[
            (I, SYN),
            (O, SYNACK),
            (I, ACK),
            (I, FINACK),
            (O, ACK),
            (O, FINACK),
            (I, ACK),
        ]);
        assert_eq!(states, vec![SR, SR, ES, CW, CW, TW, TW]);
    }

    #[test]
    fn nat_server_closes_first() {
        use TcpDir::{Input as I, Output as O};
        let states = run(&[
            (I, SYN),
            (O, SYNACK),
            (I, ACK),
            (O, FINACK),
            (I, ACK),
            (I, FINACK),
        ]);
        assert_eq!(states, vec![SR, SR, ES, FW, FW, TW]);
    }

    #[test]
    fn dr_sees_input_only() {
        let d = TcpDir::InputOnly;
        let states = run(&[(d, SYN), (d, ACK), (d, FINACK), (d, ACK)]);
        assert_eq!(states, vec![SR, ES, FW, FW]);
    }

    #[test]
    fn rst_takes_precedence_and_closes() {
        assert_eq!(next(ES, TcpDir::Input, TcpFlags(0xff)), CL);
        assert_eq!(next(ES, TcpDir::Output, RST), CL);
        // A SYN with FIN is a SYN.
        assert_eq!(
            next(NO, TcpDir::Input, TcpFlags(TcpFlags::SYN | TcpFlags::FIN)),
            SR
        );
    }

    #[test]
    fn ack_cannot_open_an_input_flow() {
        assert_eq!(next(NO, TcpDir::Input, ACK), CL);
        assert_eq!(next(NO, TcpDir::InputOnly, ACK), CL);
        assert_eq!(next(NO, TcpDir::Output, ACK), ES);
    }

    #[test]
    fn no_flags_keep_the_state() {
        for s in TcpState::ALL {
            for d in [TcpDir::Input, TcpDir::Output, TcpDir::InputOnly] {
                assert_eq!(next(s, d, TcpFlags(TcpFlags::PSH)), s);
            }
        }
    }

    #[test]
    fn direction_picks_the_table() {
        use crate::rewrite::{Direction as D, Method as M};
        assert_eq!(TcpDir::of(M::Dr, D::ToBackend), TcpDir::InputOnly);
        assert_eq!(TcpDir::of(M::Nat, D::ToBackend), TcpDir::Input);
        assert_eq!(TcpDir::of(M::Fnat, D::ToClient), TcpDir::Output);
    }

    #[test]
    fn table_columns_follow_the_enum_order() {
        for (i, s) in TcpState::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
    }

    #[test]
    fn flow_state_mapping_round_trips() {
        assert_eq!(TcpState::None.to_flow_state(), None);
        for s in TcpState::ALL.into_iter().skip(1) {
            let f = s.to_flow_state().expect("a flow state");
            assert_eq!(TcpState::from_flow_state(f), Some(s));
        }
        assert_eq!(TcpState::from_flow_state(FlowState::Udp), None);
        assert_eq!(TcpState::from_flow_state(FlowState::Persist), None);
    }
}
