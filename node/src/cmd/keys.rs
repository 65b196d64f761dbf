//! `cannabis keys`: the node's identity.

use std::path::Path;

use serde::Serialize;

use crate::cli::KeysCommand;
use crate::output::{self, out};
use cannabis_node::keystore::{self, KeyPaths, NodeKeys};

#[derive(Serialize)]
struct KeyReport {
    address: String,
    delivery_recipient: String,
    node_key: String,
    delivery_key: String,
}

impl KeyReport {
    fn new(keys: &NodeKeys, paths: &KeyPaths) -> Self {
        Self {
            address: keys.signing.address().to_string(),
            delivery_recipient: keys.delivery.recipient().to_string(),
            node_key: paths.node.display().to_string(),
            delivery_key: paths.delivery.display().to_string(),
        }
    }

    fn print(&self, json: bool) -> anyhow::Result<()> {
        if json {
            return output::json(self);
        }
        Ok(output::table(&[
            ("address", self.address.clone()),
            ("delivery recipient", self.delivery_recipient.clone()),
            ("node key", self.node_key.clone()),
            ("delivery key", self.delivery_key.clone()),
        ])?)
    }
}

pub(super) fn run(command: KeysCommand, data_dir: &Path) -> anyhow::Result<()> {
    let paths = KeyPaths::new(data_dir);
    match command {
        KeysCommand::New { force, format } => {
            let keys = keystore::create(&paths, force, super::now_ms() / 1000)?;
            KeyReport::new(&keys, &paths).print(format.json)
        }
        KeysCommand::Show { format } => {
            let keys = keystore::load(&paths)?;
            KeyReport::new(&keys, &paths).print(format.json)
        }
        KeysCommand::Address => {
            let keys = keystore::load(&paths)?;
            out!("{}", keys.signing.address())?;
            Ok(())
        }
    }
}
