//! Market engines wired together in memory: each [`Node`] is one engine with the store and
//! bookkeeping a driver keeps, and [`Envelope`]s are what travels between them. Tests
//! deliver envelopes in whatever order (and with whatever loss) they like; the simulator
//! adds delays and a CPU model. Nothing here decides anything: every rule is the engine's.

use std::collections::BTreeMap;
use std::sync::Arc;

use cannabis_protocol::{
    Address, CapabilityAd, JobOffer, Keypair, Message, Received, Signed, Timestamp,
};

use crate::{
    Answer, Command, GossipId, Heard, Identity, Inbound, InboundId, Input, Market, MarketConfig,
    MarketEvent, Origin, Outbound, OutboundId, Output, Publish, Record, RecordKey, RecordOp,
    Refusal, Reply, RunOrder,
};

/// What travels between nodes.
#[derive(Clone, Debug)]
pub enum Envelope {
    /// A gossiped ad, for every other node.
    Ad {
        /// Its author.
        from: Address,
        /// The ad.
        item: Arc<Received<CapabilityAd>>,
    },
    /// A gossiped offer, for every other node.
    Offer {
        /// Its author.
        from: Address,
        /// The offer.
        item: Arc<Received<JobOffer>>,
    },
    /// A directed request.
    Request {
        /// The sender.
        from: Address,
        /// The receiver.
        to: Address,
        /// The sender's id for it.
        req: OutboundId,
        /// The signed message.
        msg: Box<Inbound>,
    },
    /// The answer to a request.
    Response {
        /// Who answered.
        from: Address,
        /// Who asked.
        to: Address,
        /// The asker's id for it.
        req: OutboundId,
        /// The answer.
        answer: Answer,
    },
}

impl Envelope {
    /// Who it is for (`None`: every node, gossip).
    pub fn to(&self) -> Option<Address> {
        match self {
            Envelope::Ad { .. } | Envelope::Offer { .. } => None,
            Envelope::Request { to, .. } | Envelope::Response { to, .. } => Some(*to),
        }
    }

    /// Who sent it.
    pub fn from(&self) -> Address {
        match self {
            Envelope::Ad { from, .. }
            | Envelope::Offer { from, .. }
            | Envelope::Request { from, .. }
            | Envelope::Response { from, .. } => *from,
        }
    }
}

/// One node: its engine, its store, and what a driver keeps beside them.
pub struct Node {
    /// The engine.
    pub market: Market,
    /// What it persisted.
    pub store: BTreeMap<RecordKey, Record>,
    /// Everything it reported, in order.
    pub events: Vec<MarketEvent>,
    /// Refusals it answered with.
    pub refusals: Vec<Refusal>,
    /// Peers it asked to penalize, with why.
    pub penalized: Vec<(Address, Refusal)>,
    /// Batches it wrote (each one durable write).
    pub store_writes: usize,
    /// Run orders for its executor, in order.
    pub runs: Vec<RunOrder>,
    /// Deliveries whose outputs its driver is asked to fetch, in order.
    pub fetches: Vec<Signed<cannabis_protocol::DeliveryManifest>>,
    /// Checkpoints its driver is asked to fetch, in order.
    pub checkpoint_fetches: Vec<cannabis_protocol::CheckpointNote>,
    /// Synthetic products the engine asked to check.
    pub checks: Vec<crate::ProductCheck>,
    /// Evaluations the engine asked for.
    pub evaluations: Vec<crate::EvaluationOrder>,
    /// What it asked of settlement, in order (its driver signs and submits each).
    pub settles: Vec<crate::Settle>,
    config: MarketConfig,
    keys: Option<Keypair>,
    inbound: BTreeMap<InboundId, (Address, OutboundId)>,
    next_inbound: u64,
}

impl Node {
    /// A node with a fresh engine. With `keys`, it signs what it sends for real (its
    /// engine should then check signatures); without, signatures are assumed.
    pub fn new(config: MarketConfig, me: Identity, keys: Option<Keypair>, now: Timestamp) -> Self {
        Self {
            market: Market::new(config.clone(), me, now),
            store: BTreeMap::new(),
            events: Vec::new(),
            refusals: Vec::new(),
            penalized: Vec::new(),
            store_writes: 0,
            runs: Vec::new(),
            fetches: Vec::new(),
            checkpoint_fetches: Vec::new(),
            checks: Vec::new(),
            evaluations: Vec::new(),
            settles: Vec::new(),
            config,
            keys,
            inbound: BTreeMap::new(),
            next_inbound: 0,
        }
    }

    /// This node's address.
    pub fn address(&self) -> Address {
        self.market.identity().address
    }

    /// The node crashes and comes back: the engine is rebuilt from the store. Requests it
    /// had not answered are lost (their senders time out).
    pub fn restart(&mut self, now: Timestamp) {
        let me = self.market.identity().clone();
        let records = self.store.values().cloned().collect::<Vec<_>>();
        self.market = Market::restore(self.config.clone(), me, now, records);
        self.inbound.clear();
    }

    fn open<T: Message>(&self, body: T) -> Option<Received<T>> {
        match &self.keys {
            Some(k) => Signed::sign(k, &body).open().ok(),
            None => Some(Received::assumed(body, self.address())),
        }
    }

    /// Keeps this node's own ad and returns it to gossip.
    pub fn publish_ad(&mut self, now: Timestamp, ad: CapabilityAd) -> Option<Envelope> {
        let item = self.open(ad)?;
        let shared = Arc::new(item.clone());
        self.market
            .command(now, Command::KeepOwnAd(item, now.0 * 1000))
            .ok()?;
        Some(Envelope::Ad {
            from: self.address(),
            item: shared,
        })
    }

    /// Carries out everything the engine asks for: persists at once (and acknowledges),
    /// and returns what travels.
    pub fn drain(&mut self, now: Timestamp) -> Vec<Envelope> {
        let me = self.address();
        let mut out = Vec::new();
        while let Some(o) = self.market.poll_output() {
            match o {
                Output::Persist { batch, ops } => {
                    self.store_writes += 1;
                    for op in ops {
                        match op {
                            RecordOp::Put(r) => {
                                self.store.insert(r.key(), r);
                            }
                            RecordOp::Delete(k) => {
                                self.store.remove(&k);
                            }
                        }
                    }
                    self.market.persisted(batch);
                }
                Output::Validate { .. } => {}
                Output::Send { req, to, msg } => {
                    let msg = match msg {
                        Outbound::Bid(b) => self.open(b).map(Inbound::Bid),
                        Outbound::Decline(d) => self.open(d).map(Inbound::Decline),
                        Outbound::Award(a) => self.open(a).map(Inbound::Award),
                        Outbound::Accept(a) => self.open(a).map(Inbound::Accept),
                        Outbound::Renewal(r) => self.open(r).map(Inbound::Renewal),
                        Outbound::Cancel(c) => self.open(c).map(Inbound::Cancel),
                        Outbound::RunReport(r) => self.open(r).map(Inbound::RunReport),
                        Outbound::Deliver(d) => self.open(d).map(Inbound::Deliver),
                        Outbound::Checkpoint(c) => self.open(c).map(Inbound::Checkpoint),
                    };
                    if let Some(msg) = msg {
                        out.push(Envelope::Request {
                            from: me,
                            to,
                            req,
                            msg: Box::new(msg),
                        });
                    }
                }
                Output::Reply { req, answer } => {
                    let answer = match answer {
                        Reply::Ack => Answer::Ack,
                        Reply::Refused(why) => {
                            let text = why.to_string();
                            self.refusals.push(why);
                            Answer::Refused(text)
                        }
                    };
                    if let Some((to, their)) = self.inbound.remove(&req) {
                        out.push(Envelope::Response {
                            from: me,
                            to,
                            req: their,
                            answer,
                        });
                    }
                }
                Output::Publish(Publish::Offer(offer)) => {
                    if let Some(item) = self.open(offer) {
                        let shared = Arc::new(item.clone());
                        if self
                            .market
                            .command(now, Command::KeepOwnOffer(item, now.0 * 1000))
                            .is_ok()
                        {
                            out.push(Envelope::Offer {
                                from: me,
                                item: shared,
                            });
                        }
                    }
                }
                Output::Penalize { peer, why } => self.penalized.push((peer, why)),
                Output::Event(e) => self.events.push(e),
                Output::Run(order) => self.runs.push(order),
                Output::Fetch(manifest) => self.fetches.push(*manifest),
                Output::FetchCheckpoint(note) => self.checkpoint_fetches.push(*note),
                Output::CheckProduct(check) => self.checks.push(check),
                Output::Evaluate(order) => self.evaluations.push(*order),
                Output::Settle(order) => self.settles.push(order),
            }
        }
        out
    }

    /// Hands an envelope to the engine (drain afterwards).
    pub fn deliver(&mut self, now: Timestamp, envelope: Envelope) {
        let input = match envelope {
            Envelope::Ad { item, .. } => Input::Ad(Heard {
                origin: Origin::Gossip(GossipId(0)),
                received_us: now.0 * 1000,
                item,
            }),
            Envelope::Offer { item, .. } => Input::Offer(Heard {
                origin: Origin::Gossip(GossipId(0)),
                received_us: now.0 * 1000,
                item,
            }),
            Envelope::Request { from, req, msg, .. } => {
                self.next_inbound += 1;
                let id = InboundId(self.next_inbound);
                self.inbound.insert(id, (from, req));
                Input::Request {
                    req: id,
                    from,
                    msg: *msg,
                }
            }
            Envelope::Response { req, answer, .. } => Input::Response {
                req,
                result: Ok(answer),
            },
        };
        self.market.handle(now, input);
    }
}

/// Nodes and the messages in flight between them, delivered when a test says.
pub struct Net {
    /// The nodes.
    pub nodes: Vec<Node>,
    /// In flight, oldest first.
    pub queue: Vec<Envelope>,
    index: BTreeMap<Address, usize>,
}

impl Net {
    /// A network of `nodes`.
    pub fn new(nodes: Vec<Node>) -> Self {
        let index = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.address(), i))
            .collect();
        Self {
            nodes,
            queue: Vec::new(),
            index,
        }
    }

    /// The node with address `a`.
    pub fn node(&mut self, a: &Address) -> Option<&mut Node> {
        let i = *self.index.get(a)?;
        self.nodes.get_mut(i)
    }

    /// Drains node `i` into the queue.
    pub fn drain(&mut self, i: usize, now: Timestamp) {
        let out = self.nodes[i].drain(now);
        self.queue.extend(out);
    }

    /// Drains every node.
    pub fn drain_all(&mut self, now: Timestamp) {
        for i in 0..self.nodes.len() {
            self.drain(i, now);
        }
    }

    /// Every node's clock moves to `now`.
    pub fn tick(&mut self, now: Timestamp) {
        for i in 0..self.nodes.len() {
            self.nodes[i].market.handle(now, Input::Tick);
            self.drain(i, now);
        }
    }

    /// Delivers the envelope at `at` (gossip to every node but its author) and drains the
    /// receivers. With `keep`, a copy stays queued (a duplicate).
    pub fn deliver(&mut self, at: usize, now: Timestamp, keep: bool) {
        let envelope = if keep {
            self.queue[at].clone()
        } else {
            self.queue.remove(at)
        };
        let from = envelope.from();
        let to: Vec<usize> = match envelope.to() {
            Some(a) => self.index.get(&a).copied().into_iter().collect(),
            None => (0..self.nodes.len())
                .filter(|&i| self.nodes[i].address() != from)
                .collect(),
        };
        for i in to {
            self.nodes[i].deliver(now, envelope.clone());
            self.drain(i, now);
        }
    }

    /// Delivers everything in flight, and what that causes, at `now`, except what
    /// `drop` says is lost. Bounded: stops after `limit` deliveries.
    pub fn run(&mut self, now: Timestamp, drop: impl Fn(&Envelope) -> bool, limit: usize) {
        let mut n = 0;
        while !self.queue.is_empty() && n < limit {
            if drop(&self.queue[0]) {
                self.queue.remove(0);
                continue;
            }
            self.deliver(0, now, false);
            n += 1;
        }
    }

    /// Delivers everything at `now`.
    pub fn settle(&mut self, now: Timestamp) {
        self.run(now, |_| false, 100_000);
    }
}
