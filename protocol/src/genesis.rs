//! The genesis of a network: what every node of one network shares from its start, read
//! from a JSON file that is the same on all of them.
//!
//! It pins the network's fee terms and dispute resolver, names the ledger's sequencer, and
//! fixes the token: its supply, the accounts funded at the start, the vested allocations
//! (the founders' 1% among them), the testnet faucet and the pool that rewards valid
//! `SUBMIT_RESULT`s. Its id ([`Genesis::id`]) is the parent of block 1, so two networks
//! with different genesis files never share a block.
#![deny(clippy::arithmetic_side_effects)]

use serde::{Deserialize, Serialize};

use crate::{Address, Amount, BPS_DENOMINATOR, Digest, FeeTerms, Timestamp, codec};

/// Domain of the genesis id.
const GENESIS_DOMAIN: &[u8] = b"cannabis/genesis/v1";

/// A network's genesis.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Genesis {
    /// The network's name (shown by tools; part of the id).
    pub network: String,
    /// When the network starts: the time of height 0.
    pub time: Timestamp,
    /// The only key whose blocks are taken.
    pub sequencer: Address,
    /// The fee terms every job of this network pins: rate (100 bps) and recipient.
    pub fee: FeeTerms,
    /// Who resolves disputes (the evidence reaches it as the dispute's report).
    pub resolver: Address,
    /// The lowest gas price a transaction may offer.
    pub min_gas_price: u64,
    /// The token's total supply: the accounts, the vested allocations and the reward pool
    /// add up to it exactly, and no transaction creates or destroys a unit.
    pub supply: Amount,
    /// Accounts funded (and spendable) from the start.
    pub accounts: Vec<Allocation>,
    /// Allocations credited at the start but locked until they vest.
    pub vesting: Vec<Vesting>,
    /// A testnet's faucet: one of `accounts`, which hands out `grant` per request.
    pub faucet: Option<Faucet>,
    /// The reward for valid proof-of-compute results.
    pub rewards: Rewards,
    /// How often the sequencer makes a block while transactions wait, in milliseconds.
    pub block_interval_ms: u64,
    /// Most transactions in one block.
    pub max_block_txs: u32,
}

/// An account funded at the start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    /// The account.
    pub address: Address,
    /// Its balance at height 0.
    pub amount: Amount,
}

/// An allocation that vests linearly: nothing before `start + cliff_ms`, then
/// `amount * (t - start) / duration_ms` (rounded down), all of it from `start + duration_ms`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vesting {
    /// The account it is credited to.
    pub address: Address,
    /// The whole allocation.
    pub amount: Amount,
    /// When vesting starts.
    pub start: Timestamp,
    /// Nothing is spendable before `start + cliff_ms`.
    pub cliff_ms: u64,
    /// All of it is spendable from `start + duration_ms`.
    pub duration_ms: u64,
}

impl Vesting {
    /// The part still locked at `t`.
    pub fn locked_at(&self, t: Timestamp) -> Amount {
        let since = t.ms_since(self.start);
        if since < self.cliff_ms {
            return self.amount;
        }
        if since >= self.duration_ms {
            return Amount::ZERO;
        }
        // since < duration_ms, so the quotient is below `amount`: it fits.
        let vested = u128::from(self.amount.0)
            .saturating_mul(u128::from(since))
            .checked_div(u128::from(self.duration_ms))
            .unwrap_or(0);
        Amount(
            self.amount
                .0
                .saturating_sub(u64::try_from(vested).unwrap_or(u64::MAX)),
        )
    }
}

/// A testnet's faucet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faucet {
    /// The faucet's account (funded in `accounts`).
    pub address: Address,
    /// What one request receives.
    pub grant: Amount,
}

/// The reward pool for valid proof-of-compute results.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rewards {
    /// The pool, part of the supply.
    pub pool: Amount,
    /// Paid out per block, shared equally by the workers of the block's valid results
    /// (rounded down; the remainder stays in the pool).
    pub per_block: Amount,
    /// A result's seed block must be one of the last `seed_window` blocks.
    pub seed_window: u64,
}

/// Why a genesis is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenesisError {
    /// The parts do not add up to the supply.
    #[error(
        "the accounts, vested allocations and reward pool add up to {parts}, not the supply {supply}"
    )]
    Supply {
        /// What the parts add up to (saturating).
        parts: Amount,
        /// The declared supply.
        supply: Amount,
    },
    /// Something else is wrong.
    #[error("{0}")]
    Bad(String),
}

impl Genesis {
    /// The genesis id: the parent hash of block 1.
    pub fn id(&self) -> Digest {
        Digest::of_parts(&[GENESIS_DOMAIN, &[0], &codec::to_canonical(self)])
    }

    /// Checks that the genesis is consistent.
    pub fn validate(&self) -> Result<(), GenesisError> {
        let bad = |m: &str| Err(GenesisError::Bad(m.to_string()));
        if self.network.is_empty() || self.network.len() > 64 {
            return bad("network must be a name of 1 to 64 bytes");
        }
        if self.fee.rate_bps > BPS_DENOMINATOR {
            return bad("fee.rate_bps must be at most 10000 (100%)");
        }
        if self.max_block_txs == 0 {
            return bad("max_block_txs must be at least 1");
        }
        if self.block_interval_ms < 10 {
            return bad("block_interval_ms must be at least 10");
        }
        if self.rewards.seed_window == 0 {
            return bad("rewards.seed_window must be at least 1");
        }
        let mut seen = std::collections::BTreeSet::new();
        if !self.accounts.iter().all(|a| seen.insert(a.address)) {
            return bad("an account is funded twice in accounts");
        }
        if let Some(f) = &self.faucet
            && !seen.contains(&f.address)
        {
            return bad("the faucet must be one of the funded accounts");
        }
        for v in &self.vesting {
            if v.duration_ms == 0 || v.cliff_ms > v.duration_ms {
                return bad("a vesting needs duration_ms > 0 and cliff_ms <= duration_ms");
            }
        }
        let parts = self
            .accounts
            .iter()
            .map(|a| a.amount)
            .chain(self.vesting.iter().map(|v| v.amount))
            .chain([self.rewards.pool])
            .try_fold(Amount::ZERO, |sum, a| sum.checked_add(a));
        match parts {
            Ok(parts) if parts == self.supply => Ok(()),
            Ok(parts) => Err(GenesisError::Supply {
                parts,
                supply: self.supply,
            }),
            Err(_) => Err(GenesisError::Supply {
                parts: Amount::MAX,
                supply: self.supply,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Keypair;

    fn genesis() -> Genesis {
        let a = |i: u8| Keypair::from_secret([i; 32]).address();
        Genesis {
            network: "t".into(),
            time: Timestamp(1_000),
            sequencer: a(1),
            fee: FeeTerms::founder(a(2)),
            resolver: a(3),
            min_gas_price: 1,
            supply: Amount(1_000),
            accounts: vec![Allocation {
                address: a(4),
                amount: Amount(890),
            }],
            vesting: vec![Vesting {
                address: a(2),
                amount: Amount(10),
                start: Timestamp(1_000),
                cliff_ms: 100,
                duration_ms: 1_000,
            }],
            faucet: Some(Faucet {
                address: a(4),
                grant: Amount(10),
            }),
            rewards: Rewards {
                pool: Amount(100),
                per_block: Amount(5),
                seed_window: 8,
            },
            block_interval_ms: 100,
            max_block_txs: 100,
        }
    }

    #[test]
    fn the_parts_must_add_up_to_the_supply() {
        let mut g = genesis();
        assert_eq!(g.validate(), Ok(()));
        g.supply = Amount(999);
        assert!(matches!(g.validate(), Err(GenesisError::Supply { .. })));
        let mut g = genesis();
        g.faucet.as_mut().unwrap().address = g.resolver;
        assert!(g.validate().is_err());
    }

    #[test]
    fn vesting_is_linear_after_the_cliff() {
        let v = &genesis().vesting[0];
        assert_eq!(v.locked_at(Timestamp(0)), Amount(10));
        assert_eq!(v.locked_at(Timestamp(1_099)), Amount(10));
        assert_eq!(v.locked_at(Timestamp(1_100)), Amount(9));
        assert_eq!(v.locked_at(Timestamp(1_550)), Amount(5)); // 10 * 550 / 1000 = 5 vested
        assert_eq!(v.locked_at(Timestamp(2_000)), Amount(0));
    }

    #[test]
    fn the_id_changes_with_any_field() {
        let g = genesis();
        let mut h = g.clone();
        h.min_gas_price = 2;
        assert_ne!(g.id(), h.id());
        assert_eq!(g.id(), genesis().id());
    }
}
