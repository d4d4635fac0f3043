//! weir: a multi-tenant user-space L4 (TCP and UDP) load balancer.
//!
//! The daemon and the CLI live in this crate; the connection table
//! (`weir-flowtable`), the rate estimators (`weir-rate`) and the schedulers
//! (`weir-sched`) are I/O-free crates it drives. See ARCHITECTURE.md at the
//! repository root for how a connection flows through them.

pub mod admin;
pub mod cli;
pub mod config;
pub mod control;
pub mod daemon;
pub mod systemd;
// Written by the lead for the daemon to use: active health checks and
// PROXY protocol headers (pure pieces, tested on their own).
pub mod health;
pub mod proxy_protocol;
