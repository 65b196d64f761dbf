//! The local API of a cannabis node: the JSON types it serves and a blocking client of it.
//!
//! The node serves it (axum, bearer token, loopback only); the CLI and the testnet tools
//! are its clients. Keeping both sides here means the node does not depend on the testnet
//! for its own client, and a change of a type changes server and clients together.
//!
//! ```no_run
//! let client = cannabis_api::ApiClient::from_data_dir(std::path::Path::new("/var/lib/cannabis"))?;
//! println!("{} peers", client.status()?.connected_peers);
//! # Ok::<(), anyhow::Error>(())
//! ```
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod client;
mod types;

pub use client::{ApiClient, NodeInfo};
pub use types::*;
