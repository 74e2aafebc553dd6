//! opmon's client side: the API types (the agent uses these very types), the method
//! names ([`methods`]), and a typed async [`Client`] for the agent's Unix socket that
//! survives agent restarts. With the `snapshotter` feature, the [`snapshotter`] SDK;
//! with `server`, the socket server the agent and the SDK share.
//!
//! The API contract is docs/architecture.md's "The API"; names here follow it one to one.
//! Types that appear in this crate's signatures come from [`time`] and [`serde_json`],
//! re-exported so a user needs no version of its own.

pub mod client;
pub mod codes;
mod connection;
pub mod duration;
pub mod error;
pub mod methods;
pub mod openrpc;
pub mod paths;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "snapshotter")]
pub mod snapshotter;
pub mod subscription;
pub mod text;
#[cfg(feature = "server")]
pub mod traffic;
pub mod types;
pub mod validate;
mod websocket;

pub use client::{Client, ClientBuilder, EndInProgress, Owners, Update};
pub use duration::GoDuration;
pub use error::Error;
pub use paths::default_socket_path;
pub use subscription::Subscription;
pub use types::*;
pub use {serde_json, time};
