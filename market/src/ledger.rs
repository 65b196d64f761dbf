//! The embedded ledger's rules, sans-IO: accounts, nonces, gas, vesting, escrows, the
//! reward pool, ratings, and the checks every node runs on every block.
//!
//! [`Ledger`] is the state after some height. [`Ledger::apply_block`] checks a block
//! against it (the sequencer's key from the genesis, height, parent hash, time, every
//! signature, both roots, then every transaction against the balances and nonces) and
//! applies it whole or not at all. [`Ledger::propose`] is the sequencer's side: of the
//! transactions waiting, those that apply, in an order that does. Time comes from block
//! headers (and, for the "not from the future" check, from the caller): the ledger reads no
//! clock.
//!
//! Money is conserved: no transaction creates or destroys a unit, so the balances, the
//! escrows and the reward pool always add up to the genesis supply
//! ([`Ledger::total`]). Network fees go to the sequencer.
#![deny(clippy::arithmetic_side_effects)]

pub mod escrow;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use cannabis_protocol::{
    Address, Amount, Block, BlockError, BlockHeader, Digest, EscrowLock, Genesis, GenesisError,
    MoneyError, Outcome, Signed, Timestamp, Transaction, TxPayload, Uuid, Verified, Vesting,
    merkle,
};
use serde::{Deserialize, Serialize};

pub use escrow::{Escrow, EscrowRefusal, Movement, Stage, Why};

/// How far ahead of the validator's own clock a block's time may be.
pub const MAX_FUTURE_MS: u64 = 30_000;

/// Most bytes of signed transactions the sequencer puts in one block: the block's wire
/// cap less room for its header and framing.
pub const MAX_BLOCK_TX_BYTES: usize = <Block as cannabis_protocol::Wire>::MAX_SIZE - 16 * 1024;

/// An account.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    /// Its balance, vested or not.
    pub balance: Amount,
    /// The nonce its next transaction must carry.
    pub nonce: u64,
}

/// What the ledger knows of a worker, for placement to read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rating {
    /// Valid proof-of-compute results taken.
    pub results: u64,
    /// Assignments paid in full (accepted or undisputed).
    pub paid: u64,
    /// Strikes: disputes settled against the worker (rejected, or awarded less than the
    /// price).
    pub strikes: u64,
}

/// Why a transaction does not apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TxRefusal {
    /// A nonce other than the account's next one: a replay, or one that waits for others.
    #[error("nonce {got}, but the account's next is {expected}")]
    Nonce {
        /// The account's next nonce.
        expected: u64,
        /// The transaction's.
        got: u64,
    },
    /// The gas price is under the network's least.
    #[error("gas price {got} is under the network's least ({min})")]
    GasPrice {
        /// The least.
        min: u64,
        /// Offered.
        got: u64,
    },
    /// Not enough spendable money.
    #[error("needs {needs} but {spendable} is spendable ({locked} more is still vesting)")]
    Funds {
        /// Amount plus network fee.
        needs: Amount,
        /// The balance less what is still vesting.
        spendable: Amount,
        /// What is still vesting.
        locked: Amount,
    },
    /// The escrow's terms are not the network's.
    #[error("{0}")]
    Terms(String),
    /// No escrow for the job.
    #[error("no escrow for job {0}")]
    NoEscrow(Uuid),
    /// The job already has an escrow.
    #[error("job {0} already has an escrow")]
    EscrowExists(Uuid),
    /// The escrow refused.
    #[error(transparent)]
    Escrow(#[from] EscrowRefusal),
    /// A proof-of-compute result the ledger does not take.
    #[error("{0}")]
    Result(String),
    /// The money does not work out.
    #[error(transparent)]
    Money(#[from] MoneyError),
}

/// Why a block was refused. The ledger did not change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockRefusal {
    /// Signatures, counts or roots.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// Signed by a key that is not the network's sequencer.
    #[error("signed by {0}, not the network's sequencer")]
    NotSequencer(Address),
    /// Not the next height.
    #[error("height {got}, but the next is {expected}")]
    Height {
        /// The next height.
        expected: u64,
        /// The block's.
        got: u64,
    },
    /// Its parent is not the tip.
    #[error("its parent {got} is not the tip {tip}")]
    Parent {
        /// The tip's hash.
        tip: Digest,
        /// The block's parent.
        got: Digest,
    },
    /// Its time goes back, or is too far ahead of the validator's clock.
    #[error(
        "block time {got} is before its parent's ({parent}) or over {MAX_FUTURE_MS} ms ahead of {now}"
    )]
    Time {
        /// The parent's time.
        parent: Timestamp,
        /// The block's.
        got: Timestamp,
        /// The validator's clock.
        now: Timestamp,
    },
    /// More transactions than a block may hold.
    #[error("{got} transactions, over the network's {max} per block")]
    TooManyTxs {
        /// Most per block.
        max: u32,
        /// In the block.
        got: usize,
    },
    /// A transaction does not apply.
    #[error("transaction {index} ({id}): {refusal}")]
    Tx {
        /// Its position.
        index: usize,
        /// Its id.
        id: Digest,
        /// Why.
        refusal: TxRefusal,
    },
}

/// Something a block did, for receipts, balances shown and the market.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "event")]
pub enum LedgerEvent {
    /// Money left an escrow.
    Escrow {
        /// The job.
        job_id: Uuid,
        /// Where it went.
        movement: Movement,
    },
    /// A proof-of-compute reward.
    Reward {
        /// The worker.
        worker: Address,
        /// How much.
        amount: Amount,
    },
}

/// What applying a block did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The block's hash.
    pub hash: Digest,
    /// What moved, in order.
    pub events: Vec<LedgerEvent>,
}

/// The sequencer's next block: the header to sign and the transactions that apply, in
/// order; and what was left out.
#[derive(Debug)]
pub struct Proposal {
    /// The header, to sign.
    pub header: BlockHeader,
    /// The transactions, in order.
    pub txs: Vec<(Signed<Transaction>, Transaction)>,
    /// Transactions that can never apply (a used nonce) or do not apply now, and why.
    pub refused: Vec<(Signed<Transaction>, TxRefusal)>,
    /// Transactions whose nonce is ahead of their account's: they wait for the others.
    pub waiting: Vec<(Signed<Transaction>, Transaction)>,
}

/// The ledger after some height.
#[derive(Clone, Debug)]
pub struct Ledger {
    genesis: Arc<Genesis>,
    height: u64,
    tip: Digest,
    time: Timestamp,
    accounts: BTreeMap<Address, Account>,
    vesting: BTreeMap<Address, Vec<Vesting>>,
    escrows: BTreeMap<Uuid, Escrow>,
    /// (when, job): when each open escrow next has a timeout.
    due: BTreeSet<(Timestamp, Uuid)>,
    pool: Amount,
    ratings: BTreeMap<Address, Rating>,
    /// The hashes of the last `seed_window` heights (height 0: the genesis id).
    recent: VecDeque<(u64, Digest)>,
    /// By seed height, the workers whose result for it was taken.
    submitted: BTreeMap<u64, BTreeSet<Address>>,
}

impl Ledger {
    /// The ledger at height 0.
    pub fn new(genesis: Genesis) -> Result<Self, GenesisError> {
        genesis.validate()?;
        let mut accounts = BTreeMap::<Address, Account>::new();
        let mut vesting = BTreeMap::<Address, Vec<Vesting>>::new();
        for a in &genesis.accounts {
            accounts.entry(a.address).or_default().balance = a.amount;
        }
        for v in &genesis.vesting {
            let account = accounts.entry(v.address).or_default();
            // The parts add up to the supply (validated): no overflow.
            account.balance = Amount(account.balance.0.saturating_add(v.amount.0));
            vesting.entry(v.address).or_default().push(v.clone());
        }
        let id = genesis.id();
        Ok(Self {
            height: 0,
            tip: id,
            time: genesis.time,
            accounts,
            vesting,
            escrows: BTreeMap::new(),
            due: BTreeSet::new(),
            pool: genesis.rewards.pool,
            ratings: BTreeMap::new(),
            recent: VecDeque::from([(0, id)]),
            submitted: BTreeMap::new(),
            genesis: Arc::new(genesis),
        })
    }

    /// The genesis.
    pub fn genesis(&self) -> &Genesis {
        &self.genesis
    }

    /// The height of the last block applied (0: none).
    pub fn height(&self) -> u64 {
        self.height
    }

    /// The hash of the last block applied (the genesis id at height 0).
    pub fn tip(&self) -> Digest {
        self.tip
    }

    /// The time of the last block applied.
    pub fn time(&self) -> Timestamp {
        self.time
    }

    /// An account (a default one if it never held anything).
    pub fn account(&self, a: &Address) -> Account {
        self.accounts.get(a).copied().unwrap_or_default()
    }

    /// What of `a`'s balance is still vesting at `t`.
    pub fn vesting_locked(&self, a: &Address, t: Timestamp) -> Amount {
        let locked = self
            .vesting
            .get(a)
            .into_iter()
            .flatten()
            .map(|v| u128::from(v.locked_at(t).0))
            .sum::<u128>();
        Amount(u64::try_from(locked).unwrap_or(u64::MAX))
    }

    /// What `a` can spend at `t`.
    pub fn spendable(&self, a: &Address, t: Timestamp) -> Amount {
        let balance = self.account(a).balance;
        balance
            .checked_sub(self.vesting_locked(a, t))
            .unwrap_or(Amount::ZERO)
    }

    /// A job's escrow.
    pub fn escrow(&self, job: &Uuid) -> Option<&Escrow> {
        self.escrows.get(job)
    }

    /// Every escrow, by job.
    pub fn escrows(&self) -> &BTreeMap<Uuid, Escrow> {
        &self.escrows
    }

    /// A worker's rating.
    pub fn rating(&self, worker: &Address) -> Rating {
        self.ratings.get(worker).copied().unwrap_or_default()
    }

    /// The workers with strikes, and how many each (what placement weighs).
    pub fn strikes(&self) -> BTreeMap<Address, u64> {
        self.ratings
            .iter()
            .filter(|(_, r)| r.strikes > 0)
            .map(|(a, r)| (*a, r.strikes))
            .collect()
    }

    /// What is left in the reward pool.
    pub fn pool(&self) -> Amount {
        self.pool
    }

    /// The hash of a recent height, if still within the seed window.
    pub fn recent_hash(&self, height: u64) -> Option<Digest> {
        self.recent
            .iter()
            .find(|(h, _)| *h == height)
            .map(|(_, d)| *d)
    }

    /// Balances, escrows and pool added up (in 128 bits): always the genesis supply.
    pub fn total(&self) -> u128 {
        let balances: u128 = self
            .accounts
            .values()
            .map(|a| u128::from(a.balance.0))
            .sum();
        let held: u128 = self
            .escrows
            .values()
            .filter(|e| !e.is_closed())
            .map(|e| {
                let out = u128::from(e.paid_worker.0).saturating_add(u128::from(e.paid_fee.0));
                u128::from(e.locked.0).saturating_sub(out)
            })
            .sum();
        balances
            .saturating_add(held)
            .saturating_add(u128::from(self.pool.0))
    }

    /// Whether `tx` would apply on top of this state now (a wallet's or the API's check
    /// before it sends one; the block decides).
    pub fn check(&self, tx: &Transaction) -> Result<(), TxRefusal> {
        let mut d = Delta::new(self, self.time);
        d.apply(tx).map(|_| ())
    }

    /// Checks `block` (signatures, roots, sequencer, height, parent, time against `now`,
    /// every transaction) and applies it whole, or refuses it and changes nothing.
    pub fn apply_block(&mut self, block: &Block, now: Timestamp) -> Result<Applied, BlockRefusal> {
        let (header, txs) = block.verify()?;
        let bodies: Vec<&Transaction> = txs.iter().map(|t| &t.body).collect();
        self.apply_checked(&header, &bodies, now)
    }

    /// Applies a block whose signatures and roots are known good (the sequencer's own, just
    /// built from transactions it verified): the chain's checks and the transactions'.
    pub fn apply_verified(
        &mut self,
        header: &Verified<BlockHeader>,
        txs: &[&Transaction],
        now: Timestamp,
    ) -> Result<Applied, BlockRefusal> {
        self.apply_checked(header, txs, now)
    }

    fn apply_checked(
        &mut self,
        header: &Verified<BlockHeader>,
        txs: &[&Transaction],
        now: Timestamp,
    ) -> Result<Applied, BlockRefusal> {
        let h = &header.body;
        if h.sequencer != self.genesis.sequencer || header.signer != self.genesis.sequencer {
            return Err(BlockRefusal::NotSequencer(header.signer));
        }
        let next = self.height.saturating_add(1);
        if h.height != next {
            return Err(BlockRefusal::Height {
                expected: next,
                got: h.height,
            });
        }
        if h.prev_hash != self.tip {
            return Err(BlockRefusal::Parent {
                tip: self.tip,
                got: h.prev_hash,
            });
        }
        if h.timestamp < self.time || h.timestamp > now.plus_ms(MAX_FUTURE_MS) {
            return Err(BlockRefusal::Time {
                parent: self.time,
                got: h.timestamp,
                now,
            });
        }
        if txs.len() > self.genesis.max_block_txs as usize {
            return Err(BlockRefusal::TooManyTxs {
                max: self.genesis.max_block_txs,
                got: txs.len(),
            });
        }
        let mut d = Delta::new(self, h.timestamp);
        d.tick();
        for (index, tx) in txs.iter().enumerate() {
            d.apply(tx).map_err(|refusal| BlockRefusal::Tx {
                index,
                id: cannabis_protocol::message_id(*tx),
                refusal,
            })?;
        }
        d.reward();
        let (changes, events) = d.into_changes();
        self.write(changes);
        self.advance(h.height, header.id, h.timestamp);
        Ok(Applied {
            hash: header.id,
            events,
        })
    }

    fn write(&mut self, changes: Changes) {
        self.accounts.extend(changes.accounts);
        for (job, e) in changes.escrows {
            if let Some(old) = self.escrows.get(&job).and_then(Escrow::next_due) {
                self.due.remove(&(old, job));
            }
            if let Some(next) = e.next_due() {
                self.due.insert((next, job));
            }
            self.escrows.insert(job, e);
        }
        self.pool = changes.pool;
        self.ratings.extend(changes.ratings);
        for (height, worker) in changes.submitted {
            self.submitted.entry(height).or_default().insert(worker);
        }
    }

    fn advance(&mut self, height: u64, hash: Digest, time: Timestamp) {
        self.height = height;
        self.tip = hash;
        self.time = time;
        self.recent.push_back((height, hash));
        let window = self.genesis.rewards.seed_window;
        while self.recent.len() as u64 > window {
            self.recent.pop_front();
        }
        let oldest = self.recent.front().map_or(0, |(h, _)| *h);
        self.submitted = self.submitted.split_off(&oldest);
    }

    /// The sequencer's next block at `now` from `candidates` (verified, in arrival order):
    /// per sender in nonce order, each that applies on top of the ones before it, up to the
    /// network's most per block and [`MAX_BLOCK_TX_BYTES`].
    pub fn propose(
        &self,
        now: Timestamp,
        candidates: Vec<(Signed<Transaction>, Transaction)>,
    ) -> Proposal {
        let time = now.max(self.time);
        let mut d = Delta::new(self, time);
        d.tick();
        // Per sender, by nonce; senders in the order their first transaction came.
        let mut order: Vec<Address> = Vec::new();
        let mut by_sender: BTreeMap<Address, BTreeMap<u64, (Signed<Transaction>, Transaction)>> =
            BTreeMap::new();
        let mut refused = Vec::new();
        for (signed, tx) in candidates {
            let queue = by_sender.entry(tx.from_address).or_insert_with(|| {
                order.push(tx.from_address);
                BTreeMap::new()
            });
            if queue.contains_key(&tx.nonce) {
                refused.push((
                    signed,
                    TxRefusal::Nonce {
                        expected: tx.nonce.saturating_add(1),
                        got: tx.nonce,
                    },
                ));
                continue;
            }
            queue.insert(tx.nonce, (signed, tx));
        }
        let max = self.genesis.max_block_txs as usize;
        let mut txs = Vec::new();
        let mut bytes = 0usize;
        let mut waiting = Vec::new();
        for sender in order {
            for (_, (signed, tx)) in by_sender.remove(&sender).unwrap_or_default() {
                // Each in the block's array: its envelope and a few bytes of framing.
                let size = signed.to_bytes().len().saturating_add(8);
                if txs.len() >= max || bytes.saturating_add(size) > MAX_BLOCK_TX_BYTES {
                    waiting.push((signed, tx));
                    continue;
                }
                let next = d.account(&sender).nonce;
                if tx.nonce > next {
                    waiting.push((signed, tx));
                    continue;
                }
                match d.apply(&tx) {
                    Ok(()) => {
                        bytes = bytes.saturating_add(size);
                        txs.push((signed, tx));
                    }
                    Err(e) => refused.push((signed, e)),
                }
            }
        }
        let leaves = cannabis_protocol::compute_leaves(txs.iter().map(|(_, t)| t));
        let signed: Vec<Signed<Transaction>> = txs.iter().map(|(s, _)| s.clone()).collect();
        let tx_leaves: Vec<[u8; 32]> = signed.iter().map(|t| Digest::of(&t.to_bytes()).0).collect();
        let header = BlockHeader {
            height: self.height.saturating_add(1),
            prev_hash: self.tip,
            timestamp: time,
            sequencer: self.genesis.sequencer,
            tx_count: u32::try_from(txs.len()).unwrap_or(u32::MAX),
            tx_root: merkle::root(&tx_leaves),
            compute_count: u32::try_from(leaves.len()).unwrap_or(u32::MAX),
            compute_root: merkle::root(&leaves),
        };
        Proposal {
            header,
            txs,
            refused,
            waiting,
        }
    }

    /// When the next escrow timeout falls (a block at or after it settles it).
    pub fn next_due(&self) -> Option<Timestamp> {
        self.due.first().map(|(t, _)| *t)
    }

    /// The gas a requester's transactions for settling a job whose tasks have `groups`
    /// ranks each use: its lock; per task, its ranks' assignments (one `ESCROW_ASSIGN` for
    /// a single rank, an `ESCROW_ASSIGN_MANY` per [`MAX_ASSIGNED`] ranks of a group placed
    /// together); one acceptance per rank. A placement made again assigns again. The
    /// network fee is this times the gas price, charged apart from the budget.
    ///
    /// [`MAX_ASSIGNED`]: cannabis_protocol::MAX_ASSIGNED
    pub fn settlement_gas(groups: impl IntoIterator<Item = u64>) -> u64 {
        use cannabis_protocol::{MAX_ASSIGNED, TxType};
        groups
            .into_iter()
            .fold(TxType::EscrowLock.gas_limit(), |gas, ranks| {
                let ranks = ranks.max(1);
                let assign = if ranks == 1 {
                    TxType::EscrowAssign.gas_limit()
                } else {
                    ranks
                        .div_ceil(MAX_ASSIGNED as u64)
                        .saturating_mul(TxType::EscrowAssignMany.gas_limit())
                };
                gas.saturating_add(assign)
                    .saturating_add(ranks.saturating_mul(TxType::EscrowSettle.gas_limit()))
            })
    }

    /// The task id of the proof-of-compute task seeded by the block `hash`: a result for
    /// it carries this `task_id` and the block's height as its `nonce`.
    pub fn seed_task_id(hash: &Digest) -> Uuid {
        let mut b = [0u8; 16];
        b.copy_from_slice(&hash.0[..16]);
        Uuid::from_random(b)
    }
}

/// A block's changes on top of a ledger, kept apart until the whole block applied.
struct Delta<'a> {
    base: &'a Ledger,
    time: Timestamp,
    accounts: BTreeMap<Address, Account>,
    escrows: BTreeMap<Uuid, Escrow>,
    pool: Amount,
    ratings: BTreeMap<Address, Rating>,
    submitted: BTreeSet<(u64, Address)>,
    /// The workers of this block's results, for the reward.
    rewarded: Vec<Address>,
    events: Vec<LedgerEvent>,
}

impl<'a> Delta<'a> {
    fn new(base: &'a Ledger, time: Timestamp) -> Self {
        Self {
            base,
            time,
            accounts: BTreeMap::new(),
            escrows: BTreeMap::new(),
            pool: base.pool,
            ratings: BTreeMap::new(),
            submitted: BTreeSet::new(),
            rewarded: Vec::new(),
            events: Vec::new(),
        }
    }

    fn account(&self, a: &Address) -> Account {
        self.accounts
            .get(a)
            .copied()
            .unwrap_or_else(|| self.base.account(a))
    }

    fn escrow(&self, job: &Uuid) -> Option<&Escrow> {
        self.escrows.get(job).or_else(|| self.base.escrows.get(job))
    }

    fn rating_mut(&mut self, worker: &Address) -> &mut Rating {
        let base = self.base.rating(worker);
        self.ratings.entry(*worker).or_insert(base)
    }

    fn credit(&mut self, to: &Address, amount: Amount) {
        let mut a = self.account(to);
        // Money is conserved and the supply fits in u64: a balance cannot overflow.
        a.balance = Amount(a.balance.0.saturating_add(amount.0));
        self.accounts.insert(*to, a);
    }

    fn pay_out(&mut self, job_id: Uuid, moves: Vec<Movement>) {
        for m in moves {
            self.credit(&m.to, m.amount);
            if m.why == Why::WorkerShare {
                self.rating_mut(&m.to).paid = self.rating_mut(&m.to).paid.saturating_add(1);
            }
            self.events.push(LedgerEvent::Escrow {
                job_id,
                movement: m,
            });
        }
    }

    /// The timeouts due at the block's time.
    fn tick(&mut self) {
        let jobs: Vec<Uuid> = self
            .base
            .due
            .iter()
            .take_while(|(t, _)| *t <= self.time)
            .map(|(_, j)| *j)
            .collect();
        for job in jobs {
            let Some(mut e) = self.escrow(&job).cloned() else {
                continue;
            };
            let moves = e.tick(self.time);
            self.escrows.insert(job, e);
            self.pay_out(job, moves);
        }
    }

    /// Applies one transaction, or refuses it and changes nothing.
    fn apply(&mut self, tx: &Transaction) -> Result<(), TxRefusal> {
        let from = tx.from_address;
        let account = self.account(&from);
        if tx.nonce != account.nonce {
            return Err(TxRefusal::Nonce {
                expected: account.nonce,
                got: tx.nonce,
            });
        }
        let min = self.base.genesis.min_gas_price;
        if tx.gas_price < min {
            return Err(TxRefusal::GasPrice {
                min,
                got: tx.gas_price,
            });
        }
        let needs = tx.fee.checked_add(tx.amount)?;
        let locked = self.base.vesting_locked(&from, self.time);
        let spendable = account.balance.checked_sub(locked).unwrap_or(Amount::ZERO);
        if needs > spendable {
            return Err(TxRefusal::Funds {
                needs,
                spendable,
                locked,
            });
        }
        // The payload's own checks, on a copy of what it touches; nothing is written
        // before all of them passed.
        let effect = self.effect(tx)?;
        let mut sender = account;
        sender.balance = account.balance.checked_sub(needs)?;
        sender.nonce = account.nonce.saturating_add(1);
        self.accounts.insert(from, sender);
        let sequencer = self.base.genesis.sequencer;
        self.credit(&sequencer, tx.fee);
        match effect {
            Effect::Credit(to, amount) => self.credit(&to, amount),
            Effect::Escrow(e, moves) => {
                let job = e.job_id;
                self.escrows.insert(job, *e);
                self.pay_out(job, moves);
            }
            Effect::Strike(e, moves, worker) => {
                let job = e.job_id;
                self.escrows.insert(job, *e);
                self.pay_out(job, moves);
                let r = self.rating_mut(&worker);
                r.strikes = r.strikes.saturating_add(1);
            }
            Effect::Result { seed_height } => {
                self.submitted.insert((seed_height, from));
                self.rewarded.push(from);
                let r = self.rating_mut(&from);
                r.results = r.results.saturating_add(1);
            }
        }
        Ok(())
    }

    /// What the payload would do, computed without writing anything.
    fn effect(&self, tx: &Transaction) -> Result<Effect, TxRefusal> {
        let from = &tx.from_address;
        let now = self.time;
        let existing = |job: &Uuid| self.escrow(job).cloned().ok_or(TxRefusal::NoEscrow(*job));
        Ok(match &tx.payload {
            TxPayload::Transfer => {
                let to = tx
                    .to_address
                    .ok_or_else(|| TxRefusal::Terms("a transfer needs a receiver".to_string()))?;
                Effect::Credit(to, tx.amount)
            }
            TxPayload::EscrowLock(lock) => {
                self.check_lock(lock)?;
                if self.escrow(&lock.job_id).is_some() {
                    return Err(TxRefusal::EscrowExists(lock.job_id));
                }
                Effect::Escrow(Box::new(Escrow::open(*from, lock)), Vec::new())
            }
            TxPayload::EscrowAssign(a) => {
                let mut e = existing(&a.job_id)?;
                e.assign(from, now, a.task, a.rank, a.worker, a.epoch, a.price)?;
                Effect::Escrow(Box::new(e), Vec::new())
            }
            TxPayload::EscrowAssignMany(many) => {
                // On a copy: one assignment refused leaves the escrow as it was.
                let mut e = existing(&many.job_id)?;
                for a in many.each() {
                    e.assign(from, now, a.task, a.rank, a.worker, a.epoch, a.price)?;
                }
                Effect::Escrow(Box::new(e), Vec::new())
            }
            TxPayload::ResultCommit(c) => {
                let mut e = existing(&c.job_id)?;
                e.commit(from, now, c.task, c.rank, c.epoch, c.manifest)?;
                Effect::Escrow(Box::new(e), Vec::new())
            }
            TxPayload::EscrowDispute(s) => {
                let mut e = existing(&s.job_id)?;
                e.dispute(from, now, s.task, s.rank, s.epoch)?;
                Effect::Escrow(Box::new(e), Vec::new())
            }
            TxPayload::EscrowSettle(s) => {
                let mut e = existing(&s.job_id)?;
                let assigned = e.assignments.get(&(s.task, s.rank)).cloned();
                let moves = e.settle(from, now, s.task, s.rank, s.epoch, s.outcome)?;
                // A dispute settled against the worker is a strike on its rating.
                let strike = assigned.filter(|a| match s.outcome {
                    Outcome::Rejected => true,
                    Outcome::DisputeResolved { award } => award < a.price,
                    _ => false,
                });
                if let Some(a) = strike {
                    return Ok(Effect::Strike(Box::new(e), moves, a.worker));
                }
                Effect::Escrow(Box::new(e), moves)
            }
            TxPayload::EscrowCancel(c) => {
                let mut e = existing(&c.job_id)?;
                let moves = e.cancel(from, now)?;
                Effect::Escrow(Box::new(e), moves)
            }
            TxPayload::SubmitResult(r) => {
                let seed_height = r.nonce.ok_or_else(|| {
                    TxRefusal::Result(
                        "a proof-of-compute result names its seed block's height as its nonce"
                            .into(),
                    )
                })?;
                let hash = self.base.recent_hash(seed_height).ok_or_else(|| {
                    TxRefusal::Result(format!(
                        "seed block {seed_height} is not among the last {} blocks",
                        self.base.genesis.rewards.seed_window
                    ))
                })?;
                if r.task_id != Ledger::seed_task_id(&hash) {
                    return Err(TxRefusal::Result(format!(
                        "task {} is not the task block {seed_height} seeds",
                        r.task_id
                    )));
                }
                let taken = self
                    .base
                    .submitted
                    .get(&seed_height)
                    .is_some_and(|s| s.contains(from))
                    || self.submitted.contains(&(seed_height, *from));
                if taken {
                    return Err(TxRefusal::Result(format!(
                        "{from} already has a result for block {seed_height}"
                    )));
                }
                Effect::Result { seed_height }
            }
        })
    }

    fn check_lock(&self, lock: &EscrowLock) -> Result<(), TxRefusal> {
        let g = &self.base.genesis;
        if lock.fee != g.fee {
            return Err(TxRefusal::Terms(format!(
                "fee terms {} bps to {} are not the network's ({} bps to {})",
                lock.fee.rate_bps, lock.fee.recipient, g.fee.rate_bps, g.fee.recipient
            )));
        }
        if lock.resolver != g.resolver {
            return Err(TxRefusal::Terms(format!(
                "resolver {} is not the network's ({})",
                lock.resolver, g.resolver
            )));
        }
        if lock.ranks == 0 {
            return Err(TxRefusal::Terms("a job has at least one rank".into()));
        }
        if lock.deadline <= self.time {
            return Err(TxRefusal::Terms(format!(
                "the deadline {} is not after the block time {}",
                lock.deadline, self.time
            )));
        }
        Ok(())
    }

    /// The block's reward: `per_block` (or what is left of the pool) shared equally by the
    /// workers of its results, rounded down; the remainder stays in the pool.
    fn reward(&mut self) {
        let n = self.rewarded.len() as u64;
        if n == 0 {
            return;
        }
        let budget = self.pool.min(self.base.genesis.rewards.per_block);
        let each = budget.0.checked_div(n).unwrap_or(0);
        if each == 0 {
            return;
        }
        for worker in std::mem::take(&mut self.rewarded) {
            self.pool = Amount(self.pool.0.saturating_sub(each));
            self.credit(&worker, Amount(each));
            self.events.push(LedgerEvent::Reward {
                worker,
                amount: Amount(each),
            });
        }
    }

    /// The changes, owned, and what happened.
    fn into_changes(self) -> (Changes, Vec<LedgerEvent>) {
        let changes = Changes {
            accounts: self.accounts,
            escrows: self.escrows,
            pool: self.pool,
            ratings: self.ratings,
            submitted: self.submitted,
        };
        (changes, self.events)
    }
}

enum Effect {
    Credit(Address, Amount),
    Escrow(Box<Escrow>, Vec<Movement>),
    /// As `Escrow`, and a strike on the worker's rating.
    Strike(Box<Escrow>, Vec<Movement>, Address),
    Result {
        seed_height: u64,
    },
}

struct Changes {
    accounts: BTreeMap<Address, Account>,
    escrows: BTreeMap<Uuid, Escrow>,
    pool: Amount,
    ratings: BTreeMap<Address, Rating>,
    submitted: BTreeSet<(u64, Address)>,
}
