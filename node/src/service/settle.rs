//! Settlement through the node's ledger. The engine asks for escrow operations
//! ([`Settle`]); the node signs each as a transaction of its own and submits it once the
//! ledger's state lets it apply (an assignment once the lock is in a block, a commitment
//! once the assignment is, an acceptance once the delivery is committed), so the sequencer
//! drops none for being early. An order stays until its effect shows in a block: one the
//! sequencer dropped is sent again, and one whose effect is there (or can no longer come:
//! a stale epoch, a closed escrow) is let go. The lock's outcome goes back to the engine,
//! which awards nothing until it holds.

use std::time::Duration;

use cannabis_market::ledger::{Escrow, Ledger, Stage};
use cannabis_market::{Command as MarketCommand, Settle};
use cannabis_protocol::{Address, Amount, Digest, Signed, Timestamp, Transaction, Uuid};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::ledger::OWN_AHEAD;
use super::{Command, Node, now};

/// An order sent and not in a block after this long was dropped by the sequencer (its
/// nonce is given back after `OWN_PATIENCE`, 60 s): it is sent again, or, for a lock,
/// reported refused.
const RESEND_AFTER: Duration = Duration::from_secs(65);
/// An order that could not apply for this long is given up (logged).
const GIVE_UP_AFTER: Duration = Duration::from_secs(30 * 60);

/// How many times the sequencer may refuse one order before it is let go (a lock's
/// refusal then fails its job). Refusals below it are about the moment, not the order: a
/// nonce its answer to an earlier try holds, a full sequencer; the order is signed again.
const REFUSALS: u8 = 3;

/// One operation the engine asked for.
pub(crate) struct Order {
    settle: Settle,
    asked_at: tokio::time::Instant,
    sent_at: Option<tokio::time::Instant>,
    /// The transaction carrying it while the sequencer may hold it: sent again as it is
    /// when it was not delivered, so an answer lost on the way never makes two.
    signed: Option<Signed<Transaction>>,
    /// How many times the sequencer refused it.
    refused: u8,
}

/// What the ledger's state says of an order.
#[derive(Debug, PartialEq, Eq)]
enum Ready {
    /// It applies now.
    Now,
    /// Not yet: what it needs is not in a block.
    Wait,
    /// Its effect is in a block (`Ok`), or it can never apply (`Err`, why).
    Over(Result<(), String>),
}

/// Where `order` stands against `ledger`, for a node with address `me`.
fn ready(ledger: &Ledger, me: &Address, order: &Settle, now: Timestamp) -> Ready {
    let e: &Escrow = match (order, ledger.escrow(&order.job())) {
        (Settle::Lock(_), None) => return Ready::Now,
        (Settle::Lock(_), Some(e)) if e.requester == *me => return Ready::Over(Ok(())),
        (Settle::Lock(_), Some(_)) => {
            return Ready::Over(Err("another account locked an escrow for this job".into()));
        }
        // Nothing was locked: there is nothing to accept or dispute.
        (Settle::Accept(_) | Settle::Dispute(_), None) => {
            return Ready::Over(Err("the job has no escrow".into()));
        }
        (_, None) => return Ready::Wait,
        (_, Some(e)) => e,
    };
    if e.is_closed() {
        return Ready::Over(Err("the escrow is closed".into()));
    }
    match order {
        Settle::Lock(_) => Ready::Over(Ok(())),
        Settle::Assign(a) => match e.assignments.get(&(a.task, a.rank)) {
            Some(x) if x.epoch >= a.epoch => Ready::Over(Ok(())),
            _ if e.cancelled => Ready::Over(Err("the job was cancelled".into())),
            _ => Ready::Now,
        },
        Settle::AssignMany(many) => {
            let done = |a: &cannabis_protocol::Assigned| {
                e.assignments
                    .get(&(a.task, a.rank))
                    .is_some_and(|x| x.epoch >= a.epoch)
            };
            let applied = many.assignments.iter().filter(|a| done(a)).count();
            if applied == many.assignments.len() {
                Ready::Over(Ok(()))
            } else if e.cancelled {
                Ready::Over(Err("the job was cancelled".into()))
            } else if applied > 0 {
                // It applies whole or not at all, and part of it is overtaken.
                Ready::Over(Err(format!(
                    "{applied} of its {} assignments are at that epoch or later already",
                    many.assignments.len()
                )))
            } else {
                Ready::Now
            }
        }
        Settle::Commit(c) => match e.assignments.get(&(c.task, c.rank)) {
            None => Ready::Wait,
            Some(x) if x.epoch < c.epoch => Ready::Wait,
            Some(x) if x.epoch > c.epoch => Ready::Over(Err("a newer epoch holds it".into())),
            Some(x) if x.worker != *me => {
                Ready::Over(Err("the escrow assigns it to another worker".into()))
            }
            Some(x) => match x.stage {
                Stage::Assigned => Ready::Now,
                _ => Ready::Over(Ok(())),
            },
        },
        Settle::Accept(s) | Settle::Dispute(s) => {
            let dispute = matches!(order, Settle::Dispute(_));
            match e.assignments.get(&(s.task, s.rank)) {
                Some(x) if x.epoch != s.epoch => {
                    Ready::Over(Err(format!("the escrow holds epoch {}", x.epoch)))
                }
                None => Ready::Wait,
                Some(x) => match x.stage {
                    // The worker's commitment is not in a block yet.
                    Stage::Assigned => Ready::Wait,
                    Stage::Delivered { .. } => Ready::Now,
                    Stage::Disputed { .. } if dispute => Ready::Over(Ok(())),
                    // The requester may still accept what it disputed (withdrawing it).
                    Stage::Disputed { .. } => Ready::Now,
                    Stage::Settled { .. } => Ready::Over(Ok(())),
                },
            }
        }
        Settle::Cancel(_) if e.cancelled => Ready::Over(Ok(())),
        // Past the deadline the escrow's own timeout expires what is undelivered and
        // refunds it at the next block: a cancel would race it, and one the sequencer
        // drops would hold this node's next transactions behind its unused nonce.
        Settle::Cancel(_) if now >= e.deadline => Ready::Over(Ok(())),
        Settle::Cancel(_) => Ready::Now,
    }
}

/// The kind of an order, for logs.
fn kind(order: &Settle) -> &'static str {
    match order {
        Settle::Lock(_) => "lock",
        Settle::Assign(_) | Settle::AssignMany(_) => "assign",
        Settle::Commit(_) => "commit",
        Settle::Accept(_) => "accept",
        Settle::Dispute(_) => "dispute",
        Settle::Cancel(_) => "cancel",
    }
}

impl Node {
    /// Before a job is published: refused when this node's balance cannot cover its
    /// budget and the network fee of settling it (nothing is published or locked then).
    pub(super) fn can_lock(&self, template: &cannabis_market::OfferTemplate) -> anyhow::Result<()> {
        let Some(chain) = self.chain.as_ref() else {
            return Ok(());
        };
        let budget = Amount::sum(template.tasks.iter().map(|t| &t.budget))?;
        let groups = template.tasks.iter().map(|t| u64::from(t.group_size));
        let fee = Amount(
            chain
                .ledger()
                .genesis()
                .min_gas_price
                .saturating_mul(Ledger::settlement_gas(groups)),
        );
        let t = now().0.max(chain.ledger().time());
        let spendable = chain.ledger().spendable(&self.address, t);
        let needs = budget.checked_add(fee)?;
        if needs > spendable {
            anyhow::bail!(
                "the budget {budget} and the network fee {fee} of settling it need {needs}, \
                 but {spendable} is spendable by {}: fund it (on a testnet: `cannabis wallet faucet`)",
                self.address
            );
        }
        Ok(())
    }

    /// The engine asked for an escrow operation: kept, and sent once it applies.
    pub(super) fn on_settle(&mut self, settle: Settle) {
        let Some(chain) = self.chain.as_mut() else {
            // The engine asks only when the node has a ledger (its resolver comes from
            // the genesis).
            warn!(job = %settle.job(), "a settlement order without a ledger: dropped");
            return;
        };
        debug!(job = %settle.job(), kind = kind(&settle), "settlement asked");
        chain.orders.push(Order {
            settle,
            asked_at: tokio::time::Instant::now(),
            sent_at: None,
            signed: None,
            refused: 0,
        });
        // Sent when the engine's outputs are drained, with every order that came with
        // this one.
        chain.orders_new = true;
    }

    /// Sends the orders that came while the engine's outputs were drained.
    pub(super) fn settle_new(&mut self) {
        if self
            .chain
            .as_mut()
            .is_some_and(|c| std::mem::take(&mut c.orders_new))
        {
            self.settle_due();
        }
    }

    /// Tells the engine the workers' strikes when a block changed them, so that
    /// placement weighs them.
    pub(super) fn tell_strikes(&mut self) {
        let Some(chain) = self.chain.as_ref() else {
            return;
        };
        let strikes = chain.ledger().strikes();
        if strikes != *self.market.strikes() {
            let _ = self
                .market
                .command(now().0, MarketCommand::Strikes(strikes));
            self.drain();
        }
    }

    /// Sends what applies now, lets go of what is done, and tells the engine how its
    /// locks went (and the workers' strikes). After each block and at upkeep. No more than
    /// [`OWN_AHEAD`] of this node's transactions go to the sequencer before a block takes
    /// some (it holds 64 per sender and refuses the rest): a group's escrow assignments,
    /// or locks held back while the sequencer was away, go over a few blocks.
    pub(super) fn settle_due(&mut self) {
        self.tell_strikes();
        let me = self.address;
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        if chain.orders.is_empty() {
            return;
        }
        let mut due = Vec::new();
        let mut locked: Vec<(Uuid, Option<String>)> = Vec::new();
        let orders = std::mem::take(&mut chain.orders);
        let mut keep = Vec::with_capacity(orders.len());
        for mut o in orders {
            let is_lock = matches!(o.settle, Settle::Lock(_));
            let state = ready(chain.ledger(), &me, &o.settle, now().0);
            let over = matches!(state, Ready::Over(_))
                || (state == Ready::Wait && o.asked_at.elapsed() > GIVE_UP_AFTER);
            if over
                && o.sent_at.is_none()
                && let Some(signed) = &o.signed
            {
                // Let go with its last try undelivered: its nonce is free again.
                chain.own.give_back(super::ledger::nonce_of(signed));
            }
            match state {
                Ready::Over(result) => {
                    match &result {
                        Ok(()) => {
                            debug!(job = %o.settle.job(), kind = kind(&o.settle), "settlement in a block")
                        }
                        Err(why) => {
                            info!(job = %o.settle.job(), kind = kind(&o.settle), %why, "settlement order let go")
                        }
                    }
                    if is_lock {
                        locked.push((o.settle.job(), result.err()));
                    }
                }
                Ready::Wait if o.asked_at.elapsed() > GIVE_UP_AFTER => {
                    warn!(job = %o.settle.job(), kind = kind(&o.settle), "settlement order could not apply for 30 minutes: given up");
                }
                Ready::Wait => keep.push(o),
                Ready::Now => {
                    let stale = o.sent_at.is_some_and(|t| t.elapsed() > RESEND_AFTER);
                    if is_lock && stale {
                        locked.push((
                            o.settle.job(),
                            Some(
                                "the lock is in no block a minute after it was sent (the \
                                 sequencer dropped it: is the balance enough?)"
                                    .into(),
                            ),
                        ));
                        continue;
                    }
                    if o.sent_at.is_none() || stale {
                        // A transaction whose nonce went (into a block, or given up) is
                        // signed again.
                        let held = o
                            .signed
                            .as_ref()
                            .is_some_and(|s| chain.own.holds(super::ledger::nonce_of(s)));
                        if stale || !held {
                            o.signed = None;
                        }
                        due.push(keep.len());
                    }
                    keep.push(o);
                }
            }
        }
        let account = chain.ledger().account(&me).nonce;
        let mut room = OWN_AHEAD.saturating_sub(chain.own.ahead(account));
        let mut batch = Vec::with_capacity(due.len());
        for i in due {
            let o = &mut keep[i];
            let (job, what) = (o.settle.job(), kind(&o.settle));
            if o.signed.is_none() {
                if room == 0 {
                    // Sent once a block took some of this node's transactions.
                    continue;
                }
                let (amount, payload) = o.settle.clone().into_payload();
                match self.sign_own(None, amount, payload) {
                    Ok(signed) => o.signed = Some(signed),
                    Err(e) => {
                        warn!(%job, kind = what, error = %e, "settlement not signed");
                        continue;
                    }
                }
                room -= 1;
            }
            o.sent_at = Some(tokio::time::Instant::now());
            if let Some(signed) = &o.signed {
                batch.push((job, what, signed.clone()));
            }
        }
        if let Some(chain) = self.chain.as_mut() {
            chain.orders = keep;
        }
        for (job, refused) in locked {
            let changed = self
                .market
                .command(now().0, MarketCommand::Locked { job, refused });
            if let Err(e) = changed {
                debug!(%job, error = %e, "lock outcome not taken");
            }
        }
        self.send_settles(batch);
        self.drain();
    }

    /// Submits the signed orders together; the sequencer's answer to each comes back as a
    /// [`Command::SettleSent`].
    fn send_settles(&mut self, signed: Vec<(Uuid, &'static str, Signed<Transaction>)>) {
        let mut batch = Vec::with_capacity(signed.len());
        for (job, what, signed) in signed {
            let (reply, rx) = oneshot::channel::<anyhow::Result<cannabis_api::Submitted>>();
            let tx = signed.id();
            batch.push((signed, reply));
            let tell = self.self_tx.clone();
            tokio::spawn(async move {
                let result = match rx.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(Unsent {
                        reached: !e.is::<super::ledger::Unreachable>(),
                        why: format!("{e:#}"),
                    }),
                    Err(_) => return,
                };
                let _ = tell
                    .send(Command::SettleSent {
                        job,
                        lock: what == "lock",
                        tx,
                        result,
                    })
                    .await;
            });
        }
        self.submit_own_many(batch);
    }

    /// The sequencer's answer to a settlement transaction (`tx`). Undelivered: the same
    /// transaction goes again at the next upkeep or block. Refused: signed again, at most
    /// [`REFUSALS`] times, after which a lock's refusal fails its job and any other order
    /// waits [`RESEND_AFTER`] before its next try.
    pub(super) fn settle_sent(
        &mut self,
        job: Uuid,
        lock: bool,
        tx: Digest,
        result: Result<(), Unsent>,
    ) {
        let Err(Unsent { reached, why }) = result else {
            return;
        };
        let Some(chain) = self.chain.as_mut() else {
            return;
        };
        let Some(at) = chain
            .orders
            .iter()
            .position(|o| o.signed.as_ref().is_some_and(|s| s.id() == tx))
        else {
            // Over already, or signed again since.
            return;
        };
        let o = &mut chain.orders[at];
        if !reached {
            // Nothing was decided: the sequencer is down or moved (a restart).
            warn!(%job, lock, %why, "settlement transaction not delivered: sent again shortly");
            o.sent_at = None;
            return;
        }
        o.signed = None;
        o.refused = o.refused.saturating_add(1);
        warn!(%job, lock, %why, refused = o.refused, "settlement transaction refused");
        if o.refused < REFUSALS {
            o.sent_at = None;
            return;
        }
        if lock {
            chain.orders.remove(at);
            let refused = Some(why);
            if let Err(e) = self
                .market
                .command(now().0, MarketCommand::Locked { job, refused })
            {
                debug!(%job, error = %e, "lock refusal not taken");
            }
            self.drain();
        }
    }
}

/// Why a settlement transaction was not taken.
#[derive(Debug)]
pub(crate) struct Unsent {
    /// Whether the sequencer answered (it refused it); otherwise it could not be reached,
    /// and nothing was decided.
    pub(super) reached: bool,
    /// What was said.
    pub(super) why: String,
}
