//! opmon's client side: the API types (the agent uses these very types), a typed async
//! [`Client`] for the agent's Unix socket, and the [`snapshotter`] SDK.
//!
//! The API contract is ARCHITECTURE.md's "The API"; names here follow it one to one.

pub mod client;
pub mod codes;
pub mod duration;
pub mod paths;
mod refused;
pub mod server;
pub mod snapshotter;
pub mod types;
pub mod validate;

pub use client::{Client, Error, Owners};
pub use duration::GoDuration;
pub use paths::default_socket_path;
pub use types::*;
