#![doc = include_str!("../README.md")]

pub mod client;
pub mod codes;
mod connection;
pub mod duration;
pub mod error;
pub mod methods;
pub mod openrpc;
mod paths;
mod subscription;
#[cfg(feature = "internal")]
pub mod text;
#[cfg(not(feature = "internal"))]
mod text;
pub mod types;
#[cfg(feature = "internal")]
pub mod validate;
mod websocket;

pub use client::{Call, Client, ClientBuilder, Owners, Update};
pub use duration::GoDuration;
pub use error::{Error, UntrustedAgent};
pub use paths::default_socket_path;
#[cfg(feature = "internal")]
pub use paths::{first_path_of, standard_socket_path};
pub use subscription::Subscription;
pub use types::*;
pub use {serde_json, time};
