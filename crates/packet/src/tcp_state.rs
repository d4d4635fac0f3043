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
