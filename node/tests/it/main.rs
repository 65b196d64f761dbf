//! Tests of the node: the `cannabis` binary as a user runs it, and real swarms on loopback.

mod ads;
mod cli;
mod confidential;
mod dashboard;
mod delivery;
mod demo;
mod disk;
mod evaluate;
mod exec;
mod exec_restart;
mod faults;
mod group;
mod guides;
mod hostile;
mod ledger;
mod market;
mod metrics;
mod net;
mod scenario;
mod settle;
mod spot;
mod supervisor;
mod swarm;
mod testnet;
