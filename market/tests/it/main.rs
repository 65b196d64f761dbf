//! The market's integration tests, one binary: the engines of requester and workers
//! together (`lifecycle`), and the engine's own rules: bounded fan-in, early placement,
//! the fence, widening (`engine`); the fuzz target's kept job files (`fuzz_inputs`); the
//! embedded ledger's escrow, blocks and rewards (`ledger`); the engine settling through
//! a real ledger (`settle`); the confidential-execution gate (`confidential`); spot checks
//! (`spot`).

mod confidential;
mod engine;
mod fuzz_inputs;
mod ledger;
mod lifecycle;
mod settle;
mod spot;
