//! The agent's edge: everything between its socket and the API's handlers. Who may
//! connect ([`access`]), the server that bounds what all peers together may make the
//! agent hold ([`server`], with the caps of `caps.rs`), the traffic log ([`traffic`]),
//! and the metrics page on TCP ([`metrics_listener`]). See docs/trust.md.

pub mod access;
pub mod metrics_listener;
pub mod server;
pub mod traffic;
