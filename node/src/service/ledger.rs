//! The embedded ledger on the node: every node with the network's genesis keeps the
//! blocks it takes and applies each to its `market::ledger::Ledger`; the sequencer also
//! keeps the transactions it acknowledged and makes the blocks. The rules are the
//! ledger's; this module decodes, verifies, persists, sends and runs the block timer.
//!
//! Durable before sent: the sequencer answers `submitted` only once the transaction is in
//! its store, and publishes a block only once the block is; a node forwards a block only
//! once it applied and kept it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use cannabis_market::ledger::{Ledger, TxRefusal};
use cannabis_market::{Origin, RejectReason, Verdict};
use cannabis_protocol::{
    Address, Amount, Block, BlockHeader, Digest, Genesis, LedgerRequest, LedgerResponse, Signed,
    Transaction, TxPayload, Verified,
};
use libp2p::PeerId;
use libp2p::request_response::{Event, Message, OutboundRequestId, ResponseChannel};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{Command, Node, now};
use crate::store::Store;
use crate::swarm::{self, Topic};
use cannabis_api as api;

/// How a transaction that never reached the sequencer fails (nothing was decided): the
/// error a submission's reply carries, which a caller tells apart with
/// `anyhow::Error::is::<Unreachable>`.
#[derive(Debug, thiserror::Error)]
#[error("the sequencer could not be reached: {0}")]
pub(super) struct Unreachable(pub String);
/// Most blocks one `blocks` request asks for and one answer holds.
const BLOCKS_PER_ASK: u32 = 64;
/// Most bytes of blocks in one answer (past the first block).
const BLOCKS_BYTES: usize = 4 * 1024 * 1024;
/// Most transactions one sender may have waiting at the sequencer.
const WAITING_PER_SENDER: usize = 64;
/// Most transactions of its own this node has at the sequencer at once (sent and in no
/// block yet): below [`WAITING_PER_SENDER`], with room left for a wallet transfer. Escrow
/// orders past it wait for a block to take some.
pub(super) const OWN_AHEAD: usize = 48;
/// Most transactions waiting at the sequencer in all.
const WAITING_MAX: usize = 100_000;
/// Blocks above the next height kept aside while the ones between are fetched.
const AHEAD_MAX: usize = 256;
/// How often a node asks a peer whether it missed blocks.
const CATCH_UP_EVERY: Duration = Duration::from_secs(60);
/// On a new connection to a peer other than the sequencer, blocks are asked for at most
/// this often.
const ASK_ON_CONNECT_EVERY: Duration = Duration::from_secs(10);
/// How long a node whose transactions the sequencer acknowledged waits for a block before
/// it asks the sequencer for blocks; doubled after each ask that finds none, up to
/// `CATCH_UP_EVERY`. A block made in the moment between a connection and its gossip
/// subscription reaches no one ("no gossip peers"), and the minute's catch-up came too late
/// for a lock, whose sender gives it up after `RESEND_AFTER`.
const BLOCK_WATCH: Duration = Duration::from_secs(2);
/// How many `blocks` requests one peer is answered: 32 at once (2,048 blocks, a long
/// catch-up), then 60 a minute; past it a peer is refused until its allowance refills (an
/// answer reads up to 4 MiB from the store).
const BLOCKS_RATE: cannabis_market::rate::Rate = cannabis_market::rate::Rate {
    burst: 32,
    per_minute: 60,
};
/// How many transactions (and faucet requests) one peer may hand the sequencer: each is a
/// durable write. 256 at once, then 1,200 a minute.
const SUBMIT_RATE: cannabis_market::rate::Rate = cannabis_market::rate::Rate {
    burst: 256,
    per_minute: 1_200,
};
/// How long this node's own transactions may stay out of every block before it stops
/// counting them in its next nonce.
const OWN_PATIENCE: Duration = Duration::from_secs(60);
/// One faucet grant per address per this many ms.
const FAUCET_EVERY_MS: u64 = 60_000;

/// A block whose signatures and roots were checked (off the driver).
pub(crate) struct Checked {
    block: Block,
    header: Verified<BlockHeader>,
    txs: Vec<Transaction>,
}

impl Checked {
    /// Verifies `block` (signatures, counts, roots).
    pub(crate) fn verify(block: Block) -> Result<Self, String> {
        let (header, txs) = block.verify().map_err(|e| e.to_string())?;
        let txs = txs.into_iter().map(|t| t.body).collect();
        Ok(Self { block, header, txs })
    }

    fn height(&self) -> u64 {
        self.header.body.height
    }

    /// Its hash, sequencer and height.
    pub(crate) fn key(&self) -> (Digest, Address, u64) {
        (
            self.header.id,
            self.header.body.sequencer,
            self.header.body.height,
        )
    }
}

/// What a request sent for the API waits for.
type Reply = oneshot::Sender<anyhow::Result<api::Submitted>>;

/// Whose a transaction handed to the sequencer is, and what becomes of its nonce when it
/// fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sender {
    /// Signed elsewhere (`POST /v1/ledger/submit`, a faucet request).
    Other,
    /// This node's, sent once (a wallet transfer): its nonce is given back whenever it
    /// fails, undelivered or refused.
    Once(u64),
    /// This node's, sent again as it is when it was not delivered (an escrow order): its
    /// nonce is given back only when the sequencer refused it.
    Resent(u64),
}

impl Sender {
    /// The nonce to give back after a failure (`delivered`: the sequencer answered).
    fn given_back(self, delivered: bool) -> Option<u64> {
        match self {
            Sender::Other => None,
            Sender::Once(n) => Some(n),
            Sender::Resent(n) => delivered.then_some(n),
        }
    }
}

/// The nonces of this node's own transactions that the sequencer may hold (sent and not
/// answered, or acknowledged) and no block took yet. The next transaction takes the
/// lowest nonce from the account's up that none holds: a nonce given back (its transaction
/// refused, or never delivered) is used again at once, so no gap holds up the ones sent
/// after it.
#[derive(Debug, Default)]
pub(crate) struct OwnNonces {
    held: BTreeSet<u64>,
    /// When a block last took some, or the first one of an empty set was taken.
    moved_at: Option<tokio::time::Instant>,
}

impl OwnNonces {
    /// The lowest nonce at or above `account` (the account's next) that none holds.
    pub(crate) fn next(&self, account: u64) -> u64 {
        let mut n = account;
        for &h in self.held.range(account..) {
            if h != n {
                break;
            }
            n += 1;
        }
        n
    }

    /// Takes the next nonce above `account`.
    pub(crate) fn take(&mut self, account: u64) -> u64 {
        let n = self.next(account);
        if self.ahead(account) == 0 {
            self.moved_at = Some(tokio::time::Instant::now());
        }
        self.held.insert(n);
        n
    }

    /// Whether `nonce` is held.
    pub(crate) fn holds(&self, nonce: u64) -> bool {
        self.held.contains(&nonce)
    }

    /// `nonce`'s transaction is not at the sequencer: the next one takes it.
    pub(crate) fn give_back(&mut self, nonce: u64) {
        self.held.remove(&nonce);
    }

    /// A block took the account's next nonce to `account`: the ones below are spent.
    /// Whether any was.
    pub(crate) fn spent_below(&mut self, account: u64) -> bool {
        let before = self.held.len();
        self.held = self.held.split_off(&account);
        let spent = self.held.len() < before;
        if spent {
            self.moved_at = Some(tokio::time::Instant::now());
        }
        spent
    }

    /// Whether some are held and no block took any for `patience`: the sequencer dropped
    /// one (it no longer applied), and the ones after it wait behind its gap.
    fn stuck(&self, account: u64, patience: Duration) -> bool {
        self.ahead(account) > 0 && self.moved_at.is_some_and(|at| at.elapsed() > patience)
    }

    /// How many are held at or above `account`.
    pub(crate) fn ahead(&self, account: u64) -> usize {
        self.held.range(account..).count()
    }

    /// Forgets every one (the sequencer dropped them).
    pub(crate) fn clear(&mut self) {
        self.held.clear();
    }
}

/// The node's ledger.
pub(crate) struct Chain {
    ledger: Ledger,
    /// This node makes the blocks.
    sequencing: bool,
    /// Transactions acknowledged and not in a block yet (the sequencer's), in arrival
    /// order.
    waiting: Vec<(Signed<Transaction>, Transaction)>,
    /// When the next block is due (the sequencer's).
    block_at: Option<tokio::time::Instant>,
    /// Blocks above the next height, by height.
    ahead: BTreeMap<u64, Checked>,
    /// A `blocks` request in flight, and when the last one went.
    asking: Option<OutboundRequestId>,
    asked_at: Option<tokio::time::Instant>,
    /// Faucet grants, by receiver: when (ms).
    granted: HashMap<Address, u64>,
    /// The nonces of this node's own transactions at the sequencer.
    pub(super) own: OwnNonces,
    /// Ledger requests answered per peer (the allowances).
    served: cannabis_market::rate::Limiter<(PeerId, bool)>,
    /// Transactions sent to the sequencer, by request.
    pending: HashMap<OutboundRequestId, (Reply, api::Submitted, Sender)>,
    /// The engine's escrow operations not in a block yet.
    pub(super) orders: Vec<super::settle::Order>,
    /// Orders came since the last look: sent once the engine's outputs are drained, all
    /// together (a group's awards ask for one assignment per rank).
    pub(super) orders_new: bool,
    /// When to ask the sequencer for blocks if none took this node's acknowledged
    /// transactions by then ([`BLOCK_WATCH`], doubling).
    watch: crate::clock::Backoff,
}

impl Chain {
    /// The ledger from `genesis` and the blocks kept in `store`, each checked again; the
    /// transactions the sequencer acknowledged, if it is one.
    pub(crate) fn open(
        genesis: Genesis,
        sequencing: bool,
        me: &Address,
        store: &Store,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !sequencing || genesis.sequencer == *me,
            "this node ({me}) is not the genesis' sequencer ({}): it cannot sequence the ledger",
            genesis.sequencer
        );
        let mut ledger = Ledger::new(genesis)?;
        let at = now().0;
        loop {
            let kept = store.blocks(ledger.height() + 1, 256, usize::MAX)?;
            if kept.is_empty() {
                break;
            }
            for bytes in kept {
                let block: Block = cannabis_protocol::decode(&bytes)?;
                let height = ledger.height() + 1;
                ledger.apply_block(&block, at).map_err(|e| {
                    anyhow::anyhow!("block {height} kept in the store does not apply: {e}")
                })?;
            }
        }
        let mut waiting = Vec::new();
        if sequencing {
            for bytes in store.pooled()? {
                let signed: Signed<Transaction> = cannabis_protocol::decode(&bytes)?;
                let body = signed.verify()?.body;
                waiting.push((signed, body));
            }
            waiting.sort_by_key(|(_, t)| (t.from_address, t.nonce));
        }
        info!(
            height = ledger.height(),
            waiting = waiting.len(),
            sequencing,
            "ledger opened"
        );
        Ok(Self {
            ledger,
            sequencing,
            block_at: (!waiting.is_empty()).then(tokio::time::Instant::now),
            waiting,
            ahead: BTreeMap::new(),
            asking: None,
            asked_at: None,
            granted: HashMap::new(),
            own: OwnNonces::default(),
            served: cannabis_market::rate::Limiter::default(),
            pending: HashMap::new(),
            orders: Vec::new(),
            orders_new: false,
            watch: crate::clock::Backoff::new(BLOCK_WATCH, CATCH_UP_EVERY),
        })
    }

    /// When the sequencer makes its next block.
    /// The ledger's state.
    pub(crate) fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub(crate) fn block_due(&self) -> Option<tokio::time::Instant> {
        self.block_at
    }

    /// When a follower asks the sequencer for the blocks that should have taken its
    /// transactions ([`BLOCK_WATCH`]).
    pub(crate) fn block_watch(&self) -> Option<tokio::time::Instant> {
        self.watch.due()
    }

    /// A block took some of this node's transactions: the watch starts again for the rest.
    fn watched(&mut self, me: &Address) {
        self.watch.reset();
        let account = self.ledger.account(me).nonce;
        if self.own.ahead(account) > 0 {
            self.watch.arm();
        }
    }

    fn interval(&self) -> Duration {
        Duration::from_millis(self.ledger.genesis().block_interval_ms)
    }

    /// Schedules a block if there is something for one: within the block interval when
    /// transactions wait, else when the next escrow timeout falls. A block scheduled for a
    /// timeout is brought forward when a transaction arrives.
    fn schedule(&mut self) {
        if !self.sequencing {
            return;
        }
        let soon = tokio::time::Instant::now() + self.interval();
        let want = if !self.waiting.is_empty() {
            Some(soon)
        } else {
            self.ledger.next_due().map(|due| {
                let wait = due.0.saturating_sub(now().0.0);
                (tokio::time::Instant::now() + Duration::from_millis(wait)).max(soon)
            })
        };
        if let Some(want) = want {
            self.block_at = Some(self.block_at.map_or(want, |at| at.min(want)));
        }
    }

    /// Checks a transaction for the waiting list: it verified; its nonce is not below its
    /// sender's next, nor one already waiting (the very transaction again is `Ok(false)`:
    /// acknowledged again, kept once); its sender has room. `Ok(true)`: a new one.
    fn admit(&self, signed: &Signed<Transaction>, tx: &Transaction) -> Result<bool, String> {
        let next = self.ledger.account(&tx.from_address).nonce;
        if tx.nonce < next {
            return Err(format!(
                "nonce {} is used: {}'s next is {next}",
                tx.nonce, tx.from_address
            ));
        }
        let mine = self
            .waiting
            .iter()
            .filter(|(_, t)| t.from_address == tx.from_address);
        let mut count = 0;
        for (s, t) in mine {
            if t.nonce == tx.nonce {
                if s.id() == signed.id() {
                    return Ok(false);
                }
                return Err(format!("a transaction with nonce {} is waiting", tx.nonce));
            }
            count += 1;
        }
        if count >= WAITING_PER_SENDER {
            return Err(format!(
                "{WAITING_PER_SENDER} transactions of {} are waiting already",
                tx.from_address
            ));
        }
        if self.waiting.len() >= WAITING_MAX {
            return Err("the sequencer is full: try again later".into());
        }
        // A transaction that cannot apply even in turn (a bad gas price, a lock on other
        // terms) is refused now rather than dropped later.
        match self.ledger.check(tx) {
            Ok(()) | Err(TxRefusal::Nonce { .. }) => Ok(true),
            Err(e @ (TxRefusal::GasPrice { .. } | TxRefusal::Terms(_))) => Err(e.to_string()),
            Err(_) => Ok(true),
        }
    }
}

impl Node {
    /// The ledger's settings applied to the node's: blocks only from the genesis'
    /// sequencer, offers with its fee terms.
    pub(crate) fn open_chain(&mut self, genesis: Option<Genesis>) -> anyhow::Result<()> {
        let Some(genesis) = genesis else {
            return Ok(());
        };
        let mut chain = Chain::open(
            genesis,
            self.config.ledger.sequence,
            &self.address,
            &self.store,
        )?;
        // An escrow timeout due (or past) while the sequencer was stopped gets its block.
        chain.schedule();
        self.chain = Some(chain);
        self.tell_strikes();
        Ok(())
    }

    /// After a failed write the ledger is opened again from the store (the truth): a
    /// block applied in memory but not kept is taken again from peers.
    pub(super) fn restore_chain(&mut self) {
        let Some(chain) = self.chain.as_ref() else {
            return;
        };
        let genesis = chain.ledger.genesis().clone();
        match Chain::open(genesis, chain.sequencing, &self.address, &self.store) {
            Ok(c) => {
                self.chain = Some(c);
                self.tell_strikes();
            }
            Err(e) => {
                warn!(error = %format!("{e:#}"), "the ledger could not be opened again from the store")
            }
        }
    }

    /// A gossiped block that verified: applied if it is the next one (kept, then
    /// forwarded), kept aside if it is ahead (and the ones between asked for), ignored if
    /// this node has it.
    pub(super) fn on_checked_block(&mut self, origin: Origin, checked: Checked) -> Verdict {
        let hash = checked.header.id;
        let from = match origin {
            Origin::Gossip(id) => self.gossip.get(&id).map(|(_, p)| *p),
            Origin::Sync(_) => None,
        };
        let Some(chain) = self.chain.as_mut() else {
            return Verdict::Accept(hash);
        };
        let next = chain.ledger.height() + 1;
        let height = checked.height();
        if height < next {
            return Verdict::Ignore(cannabis_market::IgnoreReason::Duplicate);
        }
        if height > next {
            if chain.ahead.len() < AHEAD_MAX {
                chain.ahead.insert(height, checked);
            }
            if let Some(peer) = from {
                self.ask_blocks(peer);
            }
            // Signed by the sequencer: others behind may take it.
            return Verdict::Accept(hash);
        }
        match self.take_block(checked) {
            Ok(()) => {
                self.take_ahead();
                Verdict::Accept(hash)
            }
            Err(why) => Verdict::Reject(RejectReason::Decode(
                cannabis_protocol::DecodeError::Malformed {
                    kind: "block",
                    reason: why,
                },
            )),
        }
    }

    /// Applies the next block, keeps it, and settles what waited on it.
    fn take_block(&mut self, checked: Checked) -> Result<(), String> {
        let Some(chain) = self.chain.as_mut() else {
            return Ok(());
        };
        let height = checked.height();
        let txs: Vec<&Transaction> = checked.txs.iter().collect();
        // Applied on a copy's worth of checks first: a block that does not apply changes
        // nothing (the ledger refuses it whole).
        let applied = chain
            .ledger
            .apply_verified(&checked.header, &txs, now().0)
            .map_err(|e| e.to_string())?;
        // Not synced here: on a network of 100 nodes every node's flush of the same block
        // at once queued behind each other on the disk, and held up the durable writes
        // the market waits on (a requester's took 127 ms). A block lost in a crash is
        // fetched again from the peers.
        let bytes = cannabis_protocol::encode(&checked.block);
        if let Err(e) = self.store.put_block(height, &bytes, &[], false) {
            // The ledger moved on in memory: the store is the truth, so the node goes
            // read-only and opens the ledger again from it once writes go through.
            self.enter_safe_mode(format!("{e:#}"));
            return Ok(());
        }
        debug!(height, hash = %applied.hash, txs = txs.len(), "block taken");
        let me = self.address;
        if let Some(chain) = self.chain.as_mut() {
            let account = chain.ledger.account(&me).nonce;
            if chain.own.spent_below(account) {
                chain.watched(&me);
            }
        }
        self.settle_due();
        self.drain();
        Ok(())
    }

    /// A follower's watch ran out: its transactions the sequencer acknowledged are in no
    /// block it took, so it asks the sequencer for the blocks after its height (the block
    /// may have been made before the sequencer knew this node took gossip on blocks), and
    /// watches again, twice as long, while some are out.
    pub(super) fn watch_blocks(&mut self) {
        let me = self.address;
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        chain.watch.disarm();
        if chain.sequencing {
            return;
        }
        let account = chain.ledger.account(&me).nonce;
        let ahead = chain.own.ahead(account);
        if ahead == 0 {
            chain.watch.reset();
            return;
        }
        let waited = chain.watch.wait();
        chain.watch.double();
        chain.watch.arm();
        let Ok(peer) = sequencer_peer(chain) else {
            return;
        };
        debug!(
            ahead,
            waited_ms = waited.as_millis() as u64,
            "no block took this node's transactions: asking the sequencer for blocks"
        );
        self.ask_blocks(peer);
    }

    /// Applies the blocks kept aside that are now next.
    fn take_ahead(&mut self) {
        loop {
            let Some(chain) = self.chain.as_mut() else {
                return;
            };
            let next = chain.ledger.height() + 1;
            chain.ahead.retain(|h, _| *h >= next);
            let Some(checked) = chain.ahead.remove(&next) else {
                return;
            };
            if let Err(why) = self.take_block(checked) {
                warn!(height = next, %why, "a block kept aside does not apply");
                return;
            }
        }
    }

    /// Asks `peer` for the blocks after this node's height.
    fn ask_blocks(&mut self, peer: PeerId) {
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        if chain.asking.is_some() {
            return;
        }
        let from = chain.ledger.height() + 1;
        let id = self.swarm.behaviour_mut().ledger.send_request(
            &peer,
            LedgerRequest::Blocks {
                from,
                max: BLOCKS_PER_ASK,
            },
        );
        if let Some(chain) = self.chain.as_mut() {
            chain.asking = Some(id);
            chain.asked_at = Some(tokio::time::Instant::now());
        }
        debug!(%peer, from, "asked for blocks");
    }

    /// A peer connected: asked for the blocks after this node's height when it is the
    /// sequencer (a block it made while the two were apart reached no one), or when no
    /// peer was asked in the last `ASK_ON_CONNECT_EVERY`.
    pub(super) fn blocks_on_connect(&mut self, peer: PeerId) {
        let Some(chain) = self.chain.as_ref() else {
            return;
        };
        if chain.sequencing {
            return;
        }
        let is_sequencer = sequencer_peer(chain).is_ok_and(|p| p == peer);
        let lately = chain
            .asked_at
            .is_some_and(|at| at.elapsed() < ASK_ON_CONNECT_EVERY);
        if is_sequencer || !lately {
            self.ask_blocks(peer);
        }
    }

    /// At upkeep: when no block took any of this node's own transactions for
    /// `OWN_PATIENCE` while some are out (the sequencer dropped one: it no longer applied),
    /// its next nonce is its account's again, so the next ones do not wait behind a gap.
    pub(super) fn own_nonce_upkeep(&mut self) {
        let me = self.address;
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        chain.served.expire(now().0);
        let account = chain.ledger.account(&me).nonce;
        let ahead = chain.own.ahead(account);
        if chain.own.stuck(account, OWN_PATIENCE) {
            warn!(
                ahead,
                account,
                "transactions this node sent over a minute ago are in no block: its next nonce is its account's again"
            );
            chain.own.clear();
        }
    }

    /// At upkeep: asks a peer (the sequencer, when connected) for blocks missed, at start
    /// and every `CATCH_UP_EVERY`.
    pub(super) fn catch_up_blocks(&mut self) {
        let Some(chain) = self.chain.as_ref() else {
            return;
        };
        if chain.sequencing
            || chain.asking.is_some()
            || chain
                .asked_at
                .is_some_and(|at| at.elapsed() < CATCH_UP_EVERY)
        {
            return;
        }
        let sequencer = swarm::peer_of(&chain.ledger.genesis().sequencer);
        let peer = sequencer
            .filter(|p| self.connections.contains_key(p))
            .or_else(|| self.connections.keys().next().copied());
        if let Some(peer) = peer {
            self.ask_blocks(peer);
        }
    }

    /// Makes the next block (the sequencer, when one is due): the waiting transactions that
    /// apply, kept, applied, then published.
    pub(super) fn make_block(&mut self) {
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        chain.block_at = None;
        let at = now().0.max(chain.ledger.time());
        let due = chain.ledger.next_due().is_some_and(|d| d <= at);
        if chain.waiting.is_empty() && !due {
            return;
        }
        let candidates = std::mem::take(&mut chain.waiting);
        let proposal = chain.ledger.propose(at, candidates);
        let block = match Block::build(
            &self.keys.signing,
            proposal.header.height,
            proposal.header.prev_hash,
            proposal.header.timestamp,
            proposal.txs,
        ) {
            Ok(b) => b,
            Err(e) => {
                warn!(error = %e, "no block made");
                return;
            }
        };
        let mut done: Vec<Digest> = block.txs.iter().map(Signed::id).collect();
        for (signed, why) in &proposal.refused {
            info!(tx = %signed.id(), %why, "a waiting transaction does not apply: dropped");
            done.push(signed.id());
        }
        let height = proposal.header.height;
        let bytes = cannabis_protocol::encode(&block);
        if let Err(e) = self.store.put_block(height, &bytes, &done, true) {
            // Nothing was sent: the transactions wait for the next try.
            if let Some(chain) = self.chain.as_mut() {
                chain.waiting = block
                    .txs
                    .iter()
                    .filter_map(|s| s.verify().ok().map(|v| (s.clone(), v.body)))
                    .chain(proposal.waiting)
                    .collect();
            }
            self.enter_safe_mode(format!("{e:#}"));
            return;
        }
        let header = Verified {
            signer: self.address,
            body: proposal.header,
            id: block.hash(),
        };
        let bodies: Vec<Transaction> = block
            .txs
            .iter()
            .filter_map(|s| cannabis_protocol::decode::<Transaction>(s.payload()).ok())
            .collect();
        let refs: Vec<&Transaction> = bodies.iter().collect();
        let me = self.address;
        if let Some(chain) = self.chain.as_mut() {
            if let Err(e) = chain.ledger.apply_verified(&header, &refs, at) {
                // The proposal applied on the same state: this is a defect. The block is
                // kept; a restart applies it from the store, or says why it cannot.
                warn!(height, error = %e, "the sequencer's own block does not apply");
            }
            chain.waiting = proposal.waiting;
            let account = chain.ledger.account(&me).nonce;
            let _ = chain.own.spent_below(account);
            chain.schedule();
        }
        info!(height, hash = %header.id, txs = refs.len(), "block made");
        self.settle_due();
        self.drain();
        if let Err(e) = self.gossip_publish(Topic::Blocks, bytes) {
            warn!(height, error = %format!("{e:#}"), "block not gossiped; peers catch up by asking");
        }
    }

    /// A transaction for the waiting list (the sequencer's): checked, kept, scheduled.
    /// This node's own transactions, handed to the sequencer together: where this node
    /// sequences, each is checked and all are kept with one durable write.
    /// Escrow orders are [`Sender::Resent`]: one the sequencer could not be reached for is
    /// sent again as it is.
    pub(super) fn submit_own_many(&mut self, batch: Vec<(Signed<Transaction>, Reply)>) {
        if batch.len() < 2 || !self.chain.as_ref().is_some_and(|c| c.sequencing) {
            for (signed, reply) in batch {
                let nonce = nonce_of(&signed);
                self.submit(signed, reply, Sender::Resent(nonce));
            }
            return;
        }
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        let mut admitted = Vec::new();
        for (signed, reply) in batch {
            let checked = signed
                .verify()
                .map_err(|e| e.to_string())
                .and_then(|v| chain.admit(&signed, &v.body).map(|new| (v.body, new)));
            match checked {
                Ok((tx, new)) => admitted.push((signed, tx, new, reply)),
                Err(e) => {
                    chain.own.give_back(nonce_of(&signed));
                    let _ = reply.send(Err(anyhow::anyhow!(e)));
                }
            }
        }
        let rows: Vec<(Digest, Vec<u8>)> = admitted
            .iter()
            .filter(|(_, _, new, _)| *new)
            .map(|(signed, _, _, _)| (signed.id(), signed.to_bytes()))
            .collect();
        if let Err(e) = self.store.put_pooled_many(&rows) {
            let Some(chain) = self.chain.as_mut() else {
                return;
            };
            for (_, tx, new, reply) in admitted {
                if new {
                    chain.own.give_back(tx.nonce);
                }
                let _ = reply.send(Err(anyhow::anyhow!("not kept: {e:#}")));
            }
            return;
        }
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        for (signed, tx, new, reply) in admitted {
            let submitted = api::Submitted {
                id: signed.id().to_string(),
                from: tx.from_address.to_string(),
                nonce: tx.nonce,
                fee: tx.fee,
            };
            if new {
                chain.waiting.push((signed, tx));
            }
            let _ = reply.send(Ok(submitted));
        }
        chain.schedule();
    }

    fn keep_waiting(
        &mut self,
        signed: Signed<Transaction>,
    ) -> Result<(Digest, api::Submitted), String> {
        let Some(chain) = self.chain.as_mut() else {
            return Err("this node keeps no ledger (no genesis)".into());
        };
        if !chain.sequencing {
            return Err(format!(
                "this node does not sequence the ledger; its sequencer is {}",
                chain.ledger.genesis().sequencer
            ));
        }
        let tx = signed.verify().map_err(|e| e.to_string())?.body;
        let id = signed.id();
        let submitted = api::Submitted {
            id: id.to_string(),
            from: tx.from_address.to_string(),
            nonce: tx.nonce,
            fee: tx.fee,
        };
        if !chain.admit(&signed, &tx)? {
            // The very transaction again (its first answer was lost): kept already.
            return Ok((id, submitted));
        }
        self.store
            .put_pooled(&id, &signed.to_bytes())
            .map_err(|e| format!("not kept: {e:#}"))?;
        if let Some(chain) = self.chain.as_mut() {
            chain.waiting.push((signed, tx));
            chain.schedule();
        }
        Ok((id, submitted))
    }

    /// A faucet grant to `to`, signed by this node when it holds the faucet's key.
    fn grant(&mut self, to: Address) -> Result<(Digest, api::Submitted), String> {
        let Some(chain) = self.chain.as_mut() else {
            return Err("this node keeps no ledger (no genesis)".into());
        };
        let faucet = chain
            .ledger
            .genesis()
            .faucet
            .clone()
            .ok_or("this network has no faucet")?;
        if !chain.sequencing || faucet.address != self.address {
            return Err(format!("the faucet is {}, not this node", faucet.address));
        }
        let t = now().0.0;
        if let Some(last) = chain.granted.get(&to)
            && t.saturating_sub(*last) < FAUCET_EVERY_MS
        {
            return Err(format!(
                "{to} had a grant less than {} s ago",
                FAUCET_EVERY_MS / 1000
            ));
        }
        chain.granted.insert(to, t);
        chain
            .granted
            .retain(|_, at| t.saturating_sub(*at) < FAUCET_EVERY_MS);
        let signed = self.sign_own(Some(to), faucet.grant, TxPayload::Transfer)?;
        let nonce = nonce_of(&signed);
        let kept = self.keep_waiting(signed);
        if kept.is_err()
            && let Some(chain) = self.chain.as_mut()
        {
            chain.own.give_back(nonce);
        }
        kept
    }

    /// A transaction from this node's account, with its next nonce.
    pub(super) fn sign_own(
        &mut self,
        to: Option<Address>,
        amount: Amount,
        payload: TxPayload,
    ) -> Result<Signed<Transaction>, String> {
        let Some(chain) = self.chain.as_mut() else {
            return Err("this node keeps no ledger (no genesis)".into());
        };
        let account = chain.ledger.account(&self.address).nonce;
        let nonce = chain.own.next(account);
        let gas = chain.ledger.genesis().min_gas_price;
        let tx = Transaction::new(self.address, to, amount, nonce, gas, payload)
            .map_err(|e| e.to_string())?;
        chain.own.take(account);
        Ok(Signed::sign(&self.keys.signing, &tx))
    }

    /// Events of the ledger protocol.
    pub(super) fn on_ledger(&mut self, event: Event<LedgerRequest, LedgerResponse>) {
        match event {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => self.serve_ledger(peer, request, channel),
            Event::Message {
                peer,
                message:
                    Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => self.ledger_answered(peer, request_id, Ok(response)),
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => self.ledger_answered(peer, request_id, Err(error.to_string())),
            Event::InboundFailure { peer, error, .. } => {
                debug!(%peer, %error, "ledger request failed");
            }
            Event::ResponseSent { .. } => {}
        }
    }

    fn serve_ledger(
        &mut self,
        peer: PeerId,
        request: LedgerRequest,
        channel: ResponseChannel<LedgerResponse>,
    ) {
        let refuse = |reason: String| LedgerResponse::Refused { reason };
        let asks_blocks = matches!(request, LedgerRequest::Blocks { .. });
        let rate = if asks_blocks {
            BLOCKS_RATE
        } else {
            SUBMIT_RATE
        };
        let allowed = self
            .chain
            .as_mut()
            .is_none_or(|c| c.served.take(rate, (peer, asks_blocks), now().0));
        let answer = if self.graylisted(&peer) {
            refuse("graylisted".into())
        } else if !allowed {
            refuse("too many ledger requests from you: try again in a minute".into())
        } else if self.safe_mode.is_some() {
            refuse("the node is read-only for now (its store refused a write)".into())
        } else {
            match request {
                LedgerRequest::Blocks { from, max } => {
                    let max = max.min(BLOCKS_PER_ASK) as usize;
                    match self.store.blocks(from, max, BLOCKS_BYTES) {
                        Ok(kept) => LedgerResponse::Blocks(
                            kept.iter()
                                .filter_map(|b| cannabis_protocol::decode(b).ok())
                                .collect(),
                        ),
                        Err(e) => refuse(format!("reading blocks: {e:#}")),
                    }
                }
                LedgerRequest::Submit(signed) => match self.keep_waiting(signed) {
                    Ok((id, _)) => LedgerResponse::Submitted { id },
                    Err(why) => refuse(why),
                },
                LedgerRequest::Faucet { to } => match self.grant(to) {
                    Ok((id, _)) => LedgerResponse::Submitted { id },
                    Err(why) => refuse(why),
                },
            }
        };
        let _ = self
            .swarm
            .behaviour_mut()
            .ledger
            .send_response(channel, answer);
    }

    fn ledger_answered(
        &mut self,
        peer: PeerId,
        id: OutboundRequestId,
        answer: Result<LedgerResponse, String>,
    ) {
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        if chain.asking == Some(id) {
            chain.asking = None;
            match answer {
                Ok(LedgerResponse::Blocks(blocks)) => self.check_fetched(peer, blocks),
                Ok(other) => debug!(%peer, ?other, "no blocks"),
                Err(e) => debug!(%peer, error = %e, "asking for blocks failed"),
            }
            return;
        }
        let Some((reply, submitted, sender)) = chain.pending.remove(&id) else {
            return;
        };
        let delivered = answer.is_ok();
        if matches!(answer, Ok(LedgerResponse::Submitted { .. })) {
            // A block should take it within the watch's wait.
            chain.watch.arm();
        }
        let result = match answer {
            Ok(LedgerResponse::Submitted { id }) => Ok(api::Submitted {
                id: id.to_string(),
                ..submitted
            }),
            Ok(LedgerResponse::Refused { reason }) => {
                Err(anyhow::anyhow!("the sequencer refused it: {reason}"))
            }
            Ok(other) => Err(anyhow::anyhow!("the sequencer answered {other:?}")),
            Err(e) => Err(anyhow::Error::new(Unreachable(e.to_string()))),
        };
        if result.is_err()
            && let Some(nonce) = sender.given_back(delivered)
        {
            // The nonce was not used: the next transaction takes it.
            chain.own.give_back(nonce);
        }
        let _ = reply.send(result);
    }

    /// Blocks a peer sent on asking: verified off the driver, then taken in order.
    fn check_fetched(&mut self, peer: PeerId, blocks: Vec<Block>) {
        if blocks.is_empty() {
            return;
        }
        let full = blocks.len() >= BLOCKS_PER_ASK as usize;
        let tell = self.self_tx.clone();
        tokio::task::spawn_blocking(move || {
            let checked: Result<Vec<Checked>, String> =
                blocks.into_iter().map(Checked::verify).collect();
            let _ = tell.blocking_send(Command::BlocksFetched(peer, checked, full));
        });
    }

    /// Blocks fetched from `peer` and verified: taken in order; more asked for if the
    /// answer was full.
    pub(super) fn blocks_fetched(
        &mut self,
        peer: PeerId,
        checked: Result<Vec<Checked>, String>,
        full: bool,
    ) {
        let blocks = match checked {
            Ok(b) => b,
            Err(why) => {
                self.penalize(
                    peer,
                    super::directed::BAD_REQUEST_PENALTY,
                    &format!("sent a bad block: {why}"),
                );
                return;
            }
        };
        let mut took = 0;
        for b in blocks {
            let next = self.chain.as_ref().map_or(0, |c| c.ledger.height() + 1);
            if b.height() != next {
                continue;
            }
            if let Err(why) = self.take_block(b) {
                warn!(%peer, height = next, %why, "a fetched block does not apply");
                return;
            }
            took += 1;
        }
        self.take_ahead();
        if took > 0 {
            info!(%peer, took, height = self.chain.as_ref().map_or(0, |c| c.ledger.height()), "caught up on blocks");
        }
        if full && took > 0 {
            self.ask_blocks(peer);
        }
    }

    /// Sends a transaction of this node's to the sequencer (or keeps it, on the
    /// sequencer); `reply` gets the answer.
    pub(super) fn submit_own(&mut self, signed: Signed<Transaction>, reply: Reply) {
        let nonce = nonce_of(&signed);
        self.submit(signed, reply, Sender::Once(nonce));
    }

    /// `POST /v1/ledger/submit`: a transaction signed elsewhere (the resolver's, say),
    /// checked and handed to the sequencer.
    pub(super) fn submit_foreign(&mut self, signed: Signed<Transaction>, reply: Reply) {
        if let Err(e) = signed.verify() {
            let _ = reply.send(Err(anyhow::anyhow!("the transaction does not verify: {e}")));
            return;
        }
        self.submit(signed, reply, Sender::Other);
    }

    fn submit(&mut self, signed: Signed<Transaction>, reply: Reply, sender: Sender) {
        let Some(chain) = self.chain.as_ref() else {
            let _ = reply.send(Err(anyhow::anyhow!(
                "this node keeps no ledger (no genesis)"
            )));
            return;
        };
        if chain.sequencing {
            let kept = self
                .keep_waiting(signed)
                .map(|(_, s)| s)
                .map_err(anyhow::Error::msg);
            if kept.is_err()
                && let Some(nonce) = sender.given_back(true)
                && let Some(chain) = self.chain.as_mut()
            {
                chain.own.give_back(nonce);
            }
            let _ = reply.send(kept);
            return;
        }
        let peer = match sequencer_peer(chain) {
            Ok(p) => p,
            Err(e) => {
                if let Some(nonce) = sender.given_back(true)
                    && let Some(chain) = self.chain.as_mut()
                {
                    chain.own.give_back(nonce);
                }
                let _ = reply.send(Err(e));
                return;
            }
        };
        let tx = match signed.verify() {
            Ok(v) => v.body,
            Err(e) => {
                let _ = reply.send(Err(anyhow::anyhow!("{e}")));
                return;
            }
        };
        let submitted = api::Submitted {
            id: signed.id().to_string(),
            from: tx.from_address.to_string(),
            nonce: tx.nonce,
            fee: tx.fee,
        };
        let id = self
            .swarm
            .behaviour_mut()
            .ledger
            .send_request(&peer, LedgerRequest::Submit(signed));
        if let Some(chain) = self.chain.as_mut() {
            chain.pending.insert(id, (reply, submitted, sender));
        }
    }

    /// `POST /v1/wallet/send`.
    pub(super) fn wallet_send(&mut self, to: Address, amount: Amount, reply: Reply) {
        // What this node's ledger says it cannot pay is refused here, before a nonce is
        // used (a transfer the sequencer drops would hold up the ones after it).
        if let Some(chain) = self.chain.as_ref() {
            let g = chain.ledger.genesis();
            let fee = g
                .min_gas_price
                .saturating_mul(cannabis_protocol::TxType::Transfer.gas_limit());
            let needs = amount.0.saturating_add(fee);
            let t = now().0.max(chain.ledger.time());
            let spendable = chain.ledger.spendable(&self.address, t);
            if needs > spendable.0 {
                let _ = reply.send(Err(anyhow::anyhow!(
                    "{amount} and the network fee {fee} need {needs}, but {spendable} is spendable"
                )));
                return;
            }
        }
        match self.sign_own(Some(to), amount, TxPayload::Transfer) {
            Ok(signed) => self.submit_own(signed, reply),
            Err(e) => {
                let _ = reply.send(Err(anyhow::anyhow!(e)));
            }
        }
    }

    /// `POST /v1/wallet/faucet`: a grant to this node's account.
    pub(super) fn wallet_faucet(&mut self, reply: Reply) {
        let Some(chain) = self.chain.as_ref() else {
            let _ = reply.send(Err(anyhow::anyhow!(
                "this node keeps no ledger (no genesis)"
            )));
            return;
        };
        if chain.sequencing {
            let me = self.address;
            let _ = reply.send(self.grant(me).map(|(_, s)| s).map_err(anyhow::Error::msg));
            return;
        }
        let sequencer = chain.ledger.genesis().sequencer;
        let peer = match sequencer_peer(chain) {
            Ok(p) => p,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        // The faucet pays the network fee of its transfer.
        let fee = chain
            .ledger
            .genesis()
            .min_gas_price
            .saturating_mul(cannabis_protocol::TxType::Transfer.gas_limit());
        let submitted = api::Submitted {
            id: String::new(),
            from: sequencer.to_string(),
            nonce: 0,
            fee: Amount(fee),
        };
        let id = self
            .swarm
            .behaviour_mut()
            .ledger
            .send_request(&peer, LedgerRequest::Faucet { to: self.address });
        if let Some(chain) = self.chain.as_mut() {
            chain.pending.insert(id, (reply, submitted, Sender::Other));
        }
    }

    /// `POST /v1/ledger/compute`: the synthetic task seeded by the newest block and this
    /// node's address, computed off the driver; its signed result goes to the sequencer in
    /// a `SUBMIT_RESULT`.
    pub(super) fn compute(
        &mut self,
        n: u32,
        reply: oneshot::Sender<anyhow::Result<api::Computed>>,
    ) {
        let chain = match self.chain() {
            Ok(c) => c,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let (height, hash) = (chain.ledger.height(), chain.ledger.tip());
        let keys = self.keys.signing.clone();
        let tell = self.self_tx.clone();
        tokio::task::spawn_blocking(move || {
            let task = match cannabis_protocol::synthetic::SyntheticTask::for_block(
                &hash,
                &keys.address(),
                n,
            ) {
                Ok(t) => t,
                Err(e) => {
                    let _ = reply.send(Err(e.into()));
                    return;
                }
            };
            let started = std::time::Instant::now();
            let result_hash = task.run();
            let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            let result = cannabis_protocol::ComputeResult::signed(
                &keys,
                Ledger::seed_task_id(&hash),
                result_hash,
                None,
                Some(height),
            );
            let computed = api::Computed {
                submitted: api::Submitted {
                    id: String::new(),
                    from: keys.address().to_string(),
                    nonce: 0,
                    fee: Amount::ZERO,
                },
                result_id: result.id().to_string(),
                seed_height: height,
                seed_hash: hash.to_string(),
                n,
                result_hash: result_hash.to_string(),
                ms,
            };
            let _ = tell.blocking_send(Command::Computed(Box::new((result, computed)), reply));
        });
    }

    /// A result computed off the driver: sent in a `SUBMIT_RESULT` from this node.
    pub(super) fn computed(
        &mut self,
        (result, computed): (cannabis_protocol::ComputeResult, api::Computed),
        reply: oneshot::Sender<anyhow::Result<api::Computed>>,
    ) {
        let signed = match self.sign_own(None, Amount::ZERO, TxPayload::SubmitResult(result)) {
            Ok(s) => s,
            Err(e) => {
                let _ = reply.send(Err(anyhow::anyhow!(e)));
                return;
            }
        };
        let (tx, rx) = oneshot::channel();
        self.submit_own(signed, tx);
        tokio::spawn(async move {
            let answer = match rx.await {
                Ok(Ok(submitted)) => Ok(api::Computed {
                    submitted,
                    ..computed
                }),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(anyhow::anyhow!("the node is stopping")),
            };
            let _ = reply.send(answer);
        });
    }

    /// `GET /v1/ledger/results/{id}/proof`: the block holding result `id` (newest first)
    /// and the inclusion proof of its id in that block's `compute_root`.
    pub(super) fn prove(&self, id: &Digest) -> anyhow::Result<api::ResultProof> {
        let found = self.find_in_blocks(|block, bodies| {
            let leaves = cannabis_protocol::compute_leaves(bodies);
            let index = leaves.iter().position(|l| l == &id.0)?;
            Some((block.clone(), leaves, index))
        })?;
        let Some((block, leaves, index)) = found else {
            anyhow::bail!("no block this node holds carries result {id}");
        };
        let header: BlockHeader = cannabis_protocol::decode(block.header.payload())?;
        let proof = cannabis_protocol::merkle::prove(&leaves, index)
            .ok_or_else(|| anyhow::anyhow!("no proof for leaf {index}"))?;
        Ok(api::ResultProof {
            result_id: id.to_string(),
            height: header.height,
            block_hash: block.hash().to_string(),
            compute_root: header.compute_root.to_string(),
            compute_count: header.compute_count,
            index: proof.index,
            path: proof.path.iter().map(ToString::to_string).collect(),
        })
    }

    /// `GET /v1/ledger/txs/{id}`: the block holding transaction `id`, newest first.
    pub(super) fn tx_detail(&self, id: &Digest) -> anyhow::Result<api::TxDetail> {
        let found = self.find_in_blocks(|block, bodies| {
            let index = block.txs.iter().position(|s| s.id() == *id)?;
            Some((
                block.hash(),
                index,
                summarize_tx(&block.txs[index], &bodies[index]),
            ))
        })?;
        let Some((hash, index, tx)) = found else {
            anyhow::bail!("no block this node holds carries transaction {id}");
        };
        let height = self
            .find_height(&hash)?
            .ok_or_else(|| anyhow::anyhow!("block {hash} vanished"))?;
        Ok(api::TxDetail {
            tx,
            height,
            block_hash: hash.to_string(),
            index,
        })
    }

    /// The height of the kept block `hash`.
    fn find_height(&self, hash: &Digest) -> anyhow::Result<Option<u64>> {
        self.find_in_blocks(|block, _| {
            (block.hash() == *hash)
                .then(|| cannabis_protocol::decode::<BlockHeader>(block.header.payload()).ok())
                .flatten()
                .map(|h| h.height)
        })
    }

    /// The first of the kept blocks, newest first, for which `pick` finds something (a scan:
    /// fine for a testnet's chain; an index would serve a long one).
    fn find_in_blocks<T>(
        &self,
        pick: impl Fn(&Block, &[Transaction]) -> Option<T>,
    ) -> anyhow::Result<Option<T>> {
        let chain = self.chain()?;
        let mut height = chain.ledger.height();
        while height > 0 {
            let from = height.saturating_sub(63).max(1);
            for bytes in self.store.blocks(from, 64, usize::MAX)?.iter().rev() {
                let block: Block = cannabis_protocol::decode(bytes)?;
                let bodies: Vec<Transaction> = block
                    .txs
                    .iter()
                    .map(|s| cannabis_protocol::decode::<Transaction>(s.payload()))
                    .collect::<Result<_, _>>()?;
                if let Some(found) = pick(&block, &bodies) {
                    return Ok(Some(found));
                }
            }
            height = from - 1;
        }
        Ok(None)
    }

    /// `GET /v1/ledger`.
    pub(super) fn ledger_status(&self) -> anyhow::Result<api::LedgerStatus> {
        let chain = self.chain()?;
        let g = chain.ledger.genesis();
        Ok(api::LedgerStatus {
            network: g.network.clone(),
            genesis: g.id().to_string(),
            height: chain.ledger.height(),
            tip: chain.ledger.tip().to_string(),
            time_ms: chain.ledger.time().0,
            sequencer: g.sequencer.to_string(),
            sequencing: chain.sequencing,
            waiting: chain.waiting.len(),
            supply: g.supply,
            fee_rate_bps: g.fee.rate_bps,
            fee_recipient: g.fee.recipient.to_string(),
            resolver: g.resolver.to_string(),
            faucet: g.faucet.as_ref().map(|f| f.address.to_string()),
            reward_pool: chain.ledger.pool(),
            min_gas_price: g.min_gas_price,
        })
    }

    fn chain(&self) -> anyhow::Result<&Chain> {
        self.chain.as_ref().ok_or_else(|| {
            anyhow::anyhow!(
                "this node keeps no ledger: start it with the network's genesis (--genesis FILE)"
            )
        })
    }

    /// `GET /v1/ledger/escrows/{job}`.
    pub(super) fn escrow_of(
        &self,
        job: &cannabis_protocol::Uuid,
    ) -> anyhow::Result<cannabis_market::ledger::Escrow> {
        self.chain()?
            .ledger
            .escrow(job)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no escrow for job {job} in this node's ledger"))
    }

    /// `GET /v1/wallet/{address}`.
    pub(super) fn balance(&self, who: Option<Address>) -> anyhow::Result<api::Balance> {
        let chain = self.chain()?;
        let who = who.unwrap_or(self.address);
        let t = now().0.max(chain.ledger.time());
        let account = chain.ledger.account(&who);
        let rating = chain.ledger.rating(&who);
        Ok(api::Balance {
            address: who.to_string(),
            balance: account.balance,
            spendable: chain.ledger.spendable(&who, t),
            vesting: chain.ledger.vesting_locked(&who, t),
            nonce: account.nonce,
            height: chain.ledger.height(),
            results: rating.results,
            paid: rating.paid,
            strikes: rating.strikes,
        })
    }

    /// `GET /v1/ledger/blocks`: the newest `limit` blocks, newest first.
    pub(super) fn block_list(&self, limit: u32) -> anyhow::Result<Vec<api::BlockSummary>> {
        let chain = self.chain()?;
        let limit = u64::from(limit.clamp(1, 1000));
        let top = chain.ledger.height();
        let from = top.saturating_sub(limit - 1).max(1);
        let mut out: Vec<api::BlockSummary> = self
            .store
            .blocks(from, limit as usize, usize::MAX)?
            .iter()
            .map(|b| cannabis_protocol::decode::<Block>(b).map(|b| summary(&b)))
            .collect::<Result<_, _>>()?;
        out.reverse();
        Ok(out)
    }

    /// `GET /v1/ledger/blocks/{height}`.
    pub(super) fn block_detail(&self, height: u64) -> anyhow::Result<api::BlockDetail> {
        self.chain()?;
        let kept = self.store.blocks(height, 1, usize::MAX)?;
        let block: Block = match kept.first() {
            Some(b) => cannabis_protocol::decode(b)?,
            None => anyhow::bail!("no block {height} here"),
        };
        let b = summary(&block);
        anyhow::ensure!(b.height == height, "no block {height} here");
        let transactions = block
            .txs
            .iter()
            .filter_map(|s| {
                let t = cannabis_protocol::decode::<Transaction>(s.payload()).ok()?;
                Some(summarize_tx(s, &t))
            })
            .collect();
        Ok(api::BlockDetail {
            block: b,
            transactions,
        })
    }
}

fn summarize_tx(signed: &Signed<Transaction>, t: &Transaction) -> api::TxSummary {
    api::TxSummary {
        id: signed.id().to_string(),
        kind: t.tx_type().name().to_string(),
        from: t.from_address.to_string(),
        to: t.to_address.map(|a| a.to_string()),
        amount: t.amount,
        fee: t.fee,
        nonce: t.nonce,
    }
}

/// The nonce of a transaction this node signed.
pub(super) fn nonce_of(signed: &Signed<Transaction>) -> u64 {
    cannabis_protocol::decode::<Transaction>(signed.payload()).map_or(0, |t| t.nonce)
}

/// The sequencer's peer id.
fn sequencer_peer(chain: &Chain) -> anyhow::Result<PeerId> {
    let sequencer = chain.ledger.genesis().sequencer;
    swarm::peer_of(&sequencer)
        .ok_or_else(|| anyhow::anyhow!("the sequencer's address {sequencer} names no peer"))
}

fn summary(block: &Block) -> api::BlockSummary {
    let h = cannabis_protocol::decode::<BlockHeader>(block.header.payload()).ok();
    api::BlockSummary {
        height: h.as_ref().map_or(0, |h| h.height),
        hash: block.hash().to_string(),
        prev_hash: h
            .as_ref()
            .map_or(String::new(), |h| h.prev_hash.to_string()),
        time_ms: h.as_ref().map_or(0, |h| h.timestamp.0),
        txs: h.as_ref().map_or(0, |h| h.tx_count),
        compute_count: h.as_ref().map_or(0, |h| h.compute_count),
        compute_root: h
            .as_ref()
            .map_or(String::new(), |h| h.compute_root.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::OwnNonces;

    #[test]
    fn own_nonces_fill_the_gap_a_given_back_one_leaves() {
        let mut own = OwnNonces::default();
        // Account at 5: three sent.
        assert_eq!((own.take(5), own.take(5), own.take(5)), (5, 6, 7));
        assert_eq!(own.ahead(5), 3);
        // 6 was refused: the next one takes it, then goes on past 7.
        own.give_back(6);
        assert!(!own.holds(6));
        assert_eq!(own.take(5), 6);
        assert_eq!(own.take(5), 8);
        // A block took 5 and 6: they are spent, the rest still held.
        own.spent_below(7);
        assert_eq!(own.ahead(7), 2);
        assert!(own.holds(7) && own.holds(8) && !own.holds(5));
        assert_eq!(own.next(7), 9);
        // Another node's view of the account ahead of this one's: nothing below it counts.
        assert_eq!(own.next(20), 20);
        own.clear();
        assert_eq!((own.ahead(7), own.next(7)), (0, 7));
    }
}
