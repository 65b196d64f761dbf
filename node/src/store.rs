//! The node's store: one redb file under the data directory.
//!
//! redb rather than sled: sled 0.34 is beta, flushes with `sync_file_range` (no durability
//! guarantee) and has open reports of databases that will not open after an abrupt stop.
//! redb is ACID and durable when `commit` returns. See `docs/architecture.md`.
//!
//! What is kept: the market engine's records (`cannabis_market::Record`): the signed ads and
//! offers of the live view (re-verified when loaded), challenge passes other nodes signed
//! for this one (by verifier), the jobs this node published with their bids, leases and
//! epochs (JSON, by job id), the bids and leases it holds as a worker, and the sequence
//! counters (so a restart never reuses a sequence number); each batch the engine asks for
//! is one transaction. Beside them: the executor's attempt journal.

use std::path::{Path, PathBuf};
use std::sync::{RwLock, RwLockReadGuard};

use anyhow::Context as _;
use cannabis_market::lease::AssignmentKey;
use cannabis_market::{Record, RecordKey, RecordOp};
use cannabis_protocol::Uuid;
use redb::{Database, ReadableDatabase as _, ReadableTable as _, TableDefinition};

const ADS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("ads");
const OFFERS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("offers");
const COUNTERS: TableDefinition<'_, &str, u64> = TableDefinition::new("counters");
const PASSES: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("challenge_passes");
const JOBS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("jobs");
const WORKER_BIDS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("worker_bids");
const WORKER_LEASES: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("worker_leases");
const EXEC: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("exec_journal");

type Table = TableDefinition<'static, &'static [u8], &'static [u8]>;

const TABLES: [Table; 7] = [ADS, OFFERS, PASSES, JOBS, WORKER_BIDS, WORKER_LEASES, EXEC];

fn assignment_key(key: &AssignmentKey) -> Vec<u8> {
    let mut k = key.0.0.to_vec();
    k.extend_from_slice(&key.1.to_le_bytes());
    k.extend_from_slice(&key.2.to_le_bytes());
    k
}

fn parse_assignment_key(k: &[u8]) -> Option<AssignmentKey> {
    let uuid: [u8; 16] = k.get(..16)?.try_into().ok()?;
    let task = u32::from_le_bytes(k.get(16..20)?.try_into().ok()?);
    let rank = u32::from_le_bytes(k.get(20..24)?.try_into().ok()?);
    Some((Uuid(uuid), task, rank))
}

/// Where a market record lives: its table and key (counters have a table of their own,
/// name to `u64`).
fn place(key: &RecordKey) -> Option<(Table, Vec<u8>)> {
    Some(match key {
        RecordKey::Ad(node) => (ADS, node.to_string().into_bytes()),
        RecordKey::Offer(job) => (OFFERS, job.0.to_vec()),
        RecordKey::Job(job) => (JOBS, job.0.to_vec()),
        RecordKey::SentBid(id) => (WORKER_BIDS, id.0.to_vec()),
        RecordKey::Lease(k) => (WORKER_LEASES, assignment_key(k)),
        RecordKey::Pass(v) => (PASSES, v.to_string().into_bytes()),
        RecordKey::Counter(_) => return None,
    })
}

fn timed(received_us: u64, signed: &[u8]) -> Vec<u8> {
    let mut value = Vec::with_capacity(8 + signed.len());
    value.extend_from_slice(&received_us.to_le_bytes());
    value.extend_from_slice(signed);
    value
}

fn untimed(v: &[u8]) -> Option<(u64, &[u8])> {
    let (time, rest) = v.split_at_checked(8)?;
    Some((u64::from_le_bytes(time.try_into().ok()?), rest))
}

/// The value a market record is stored as.
fn encode(record: &Record) -> anyhow::Result<Vec<u8>> {
    Ok(match record {
        Record::Ad {
            signed,
            received_us,
            ..
        } => timed(*received_us, &signed.to_bytes()),
        Record::Offer {
            signed,
            received_us,
            ..
        } => timed(*received_us, &signed.to_bytes()),
        Record::Job(job) => serde_json::to_vec(job)?,
        Record::SentBid(_, sent) => serde_json::to_vec(sent)?,
        Record::Lease(_, lease) => serde_json::to_vec(lease)?,
        Record::Pass { signed, .. } => signed.to_bytes(),
        Record::Counter(_, value) => value.to_le_bytes().to_vec(),
    })
}

/// Turns a stored row (key, value) back into a market record.
type Decoder<'a> = dyn FnMut(&[u8], &[u8]) -> Option<Record> + 'a;

/// Records a store keeps as opaque bytes under a byte key.
#[derive(Clone, Copy, Debug)]
pub enum Records {
    /// The executor's attempt journal and owner switch (JSON), by record key.
    Exec,
}

/// The node's store.
pub struct Store {
    path: PathBuf,
    /// `None` only while it is reopened.
    db: RwLock<Option<Database>>,
}

/// The open database, for one operation.
struct Db<'a>(RwLockReadGuard<'a, Option<Database>>);

impl std::ops::Deref for Db<'_> {
    type Target = Database;
    fn deref(&self) -> &Database {
        self.0.as_ref().expect("checked when the guard was made")
    }
}

fn create(path: &Path) -> anyhow::Result<Database> {
    let db = Database::create(path)
        .with_context(|| format!("opening the store at {}", path.display()))?;
    let txn = db.begin_write()?;
    txn.open_table(COUNTERS)?;
    for t in TABLES {
        txn.open_table(t)?;
    }
    // Bids received for offers were kept here once; they now live in their jobs.
    let _ = txn.delete_table(TableDefinition::<&[u8], &[u8]>::new("bids"));
    txn.commit()?;
    Ok(db)
}

impl Store {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            db: RwLock::new(Some(create(path)?)),
            path: path.to_path_buf(),
        })
    }

    fn db(&self) -> anyhow::Result<Db<'_>> {
        let guard = self.db.read().unwrap_or_else(|p| p.into_inner());
        anyhow::ensure!(guard.is_some(), "the store is being reopened");
        Ok(Db(guard))
    }

    /// Closes and opens the store again: after a failed write redb refuses everything
    /// until it is reopened. Fails while the disk still refuses.
    pub fn reopen(&self) -> anyhow::Result<()> {
        let mut guard = self.db.write().unwrap_or_else(|p| p.into_inner());
        drop(guard.take());
        *guard = Some(create(&self.path)?);
        Ok(())
    }

    /// Whether a durable write goes through now: a counter of its own, written and
    /// synced.
    pub fn probe_write(&self) -> anyhow::Result<()> {
        self.next_seq("store-probe", 0).map(|_| ())
    }

    /// Writes a batch of the market's records in one transaction: durable when this
    /// returns, or not written at all. A batch of nothing but gossiped ads and offers is
    /// written without a sync: losing the newest few in a crash loses nothing that peers
    /// cannot give back (sync brings them again), and a sync per gossiped message would
    /// cost every node a disk flush per offer in the network. The next durable batch
    /// makes them durable too. The node's own ads and offers (signed by `me`) are others'
    /// gossip but this node's word: a batch holding one is synced before it is
    /// acknowledged.
    pub fn apply(&self, ops: &[RecordOp], me: &cannabis_protocol::Address) -> anyhow::Result<()> {
        let db = self.db()?;
        let mut txn = db.begin_write()?;
        let gossip_only = ops.iter().all(|op| match op {
            RecordOp::Put(Record::Ad { node, .. }) => node != me,
            RecordOp::Put(Record::Offer { signed, .. }) => !signed.names_signer(me),
            RecordOp::Delete(RecordKey::Ad(_) | RecordKey::Offer(_)) => true,
            _ => false,
        });
        if gossip_only {
            txn.set_durability(redb::Durability::None)
                .context("writing gossip without a sync")?;
        }
        {
            let mut counters = txn.open_table(COUNTERS)?;
            for op in ops {
                match op {
                    RecordOp::Put(Record::Counter(name, value)) => {
                        counters.insert(name.as_str(), *value)?;
                    }
                    RecordOp::Delete(RecordKey::Counter(name)) => {
                        counters.remove(name.as_str())?;
                    }
                    RecordOp::Put(record) => {
                        if let Some((table, key)) = place(&record.key()) {
                            let value = encode(record)?;
                            txn.open_table(table)?
                                .insert(key.as_slice(), value.as_slice())?;
                        }
                    }
                    RecordOp::Delete(key) => {
                        if let Some((table, key)) = place(key) {
                            txn.open_table(table)?.remove(key.as_slice())?;
                        }
                    }
                }
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Every market record kept. Values that no longer decode are named in the log and
    /// left where they are.
    pub fn load_records(&self) -> anyhow::Result<Vec<Record>> {
        use cannabis_protocol::{Address, Digest, Signed};
        let db = self.db()?;
        let txn = db.begin_read()?;
        let mut out = Vec::new();
        let mut skipped = 0usize;
        let mut rows = |table: Table, f: &mut Decoder<'_>| {
            let t = txn.open_table(table)?;
            for row in t.iter()? {
                let (k, v) = row?;
                match f(k.value(), v.value()) {
                    Some(r) => out.push(r),
                    None => skipped += 1,
                }
            }
            anyhow::Ok(())
        };
        let address = |k: &[u8]| std::str::from_utf8(k).ok()?.parse::<Address>().ok();
        rows(ADS, &mut |k, v| {
            let (received_us, bytes) = untimed(v)?;
            Some(Record::Ad {
                node: address(k)?,
                signed: Signed::from_bytes(bytes).ok()?,
                received_us,
            })
        })?;
        rows(OFFERS, &mut |k, v| {
            let (received_us, bytes) = untimed(v)?;
            Some(Record::Offer {
                job: Uuid(k.try_into().ok()?),
                signed: Signed::from_bytes(bytes).ok()?,
                received_us,
            })
        })?;
        rows(JOBS, &mut |_, v| {
            serde_json::from_slice(v)
                .ok()
                .map(|j| Record::Job(Box::new(j)))
        })?;
        rows(WORKER_BIDS, &mut |k, v| {
            Some(Record::SentBid(
                Digest(k.try_into().ok()?),
                serde_json::from_slice(v).ok()?,
            ))
        })?;
        rows(WORKER_LEASES, &mut |k, v| {
            Some(Record::Lease(
                parse_assignment_key(k)?,
                serde_json::from_slice(v).ok()?,
            ))
        })?;
        rows(PASSES, &mut |k, v| {
            Some(Record::Pass {
                verifier: address(k)?,
                signed: Signed::from_bytes(v).ok()?,
            })
        })?;
        let counters = txn.open_table(COUNTERS)?;
        for row in counters.iter()? {
            let (k, v) = row?;
            if k.value() != "ad" {
                out.push(Record::Counter(k.value().to_string(), v.value()));
            }
        }
        if skipped > 0 {
            tracing::warn!(
                skipped,
                "kept market records that no longer decode were left in the store"
            );
        }
        Ok(out)
    }

    /// Keeps a record under `key`, replacing the previous one; durable when this returns.
    pub fn put_record(&self, records: Records, key: &[u8], value: &[u8]) -> anyhow::Result<()> {
        let db = self.db()?;
        let txn = db.begin_write()?;
        txn.open_table(records.table())?.insert(key, value)?;
        txn.commit()?;
        Ok(())
    }

    /// Every record kept, as `(key, value)`.
    pub fn records(&self, records: Records) -> anyhow::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let db = self.db()?;
        let txn = db.begin_read()?;
        let table = txn.open_table(records.table())?;
        table
            .iter()?
            .map(|row| {
                let (k, v) = row?;
                Ok((k.value().to_vec(), v.value().to_vec()))
            })
            .collect()
    }

    /// The next value of counter `name`: above every value it returned before (durably),
    /// and at least `floor`.
    pub fn next_seq(&self, name: &str, floor: u64) -> anyhow::Result<u64> {
        let db = self.db()?;
        let txn = db.begin_write()?;
        let next = {
            let mut table = txn.open_table(COUNTERS)?;
            let last = table.get(name)?.map(|v| v.value()).unwrap_or(0);
            let next = last.saturating_add(1).max(floor);
            table.insert(name, next)?;
            next
        };
        txn.commit()?;
        Ok(next)
    }
}

impl Records {
    fn table(self) -> Table {
        match self {
            Records::Exec => EXEC,
        }
    }
}

/// The executor's journal: every record is committed (durably) before `put` returns.
impl cannabis_runtime::exec::Journal for Store {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        self.put_record(Records::Exec, key.as_bytes(), value)
            .map_err(|e| format!("{e:#}"))
    }

    fn all(&self) -> Result<Vec<(String, Vec<u8>)>, String> {
        let rows = self.records(Records::Exec).map_err(|e| format!("{e:#}"))?;
        Ok(rows
            .into_iter()
            .map(|(k, v)| (String::from_utf8_lossy(&k).into_owned(), v))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cannabis_protocol::{Keypair, Signed, Timestamp};

    #[test]
    fn records_survive_reopening_and_deletes_are_applied() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.redb");
        let k = Keypair::from_secret([3; 32]);
        let pass = cannabis_protocol::ChallengePass {
            verifier: k.address(),
            worker: Keypair::from_secret([4; 32]).address(),
            seed: cannabis_protocol::Digest([1; 32]),
            n: 64,
            rounds: 1,
            claimed_cores: 2,
            took_ms: 1,
            deadline_ms: 10,
            passed_at: Timestamp(5),
        };
        {
            let s = Store::open(&path).unwrap();
            s.apply(
                &[
                    RecordOp::Put(Record::Counter("offer".into(), 7)),
                    RecordOp::Put(Record::Pass {
                        verifier: k.address(),
                        signed: Signed::sign(&k, &pass),
                    }),
                ],
                &k.address(),
            )
            .unwrap();
            assert_eq!(s.next_seq("ad", 0).unwrap(), 1);
            assert_eq!(s.next_seq("ad", 0).unwrap(), 2);
        }
        let s = Store::open(&path).unwrap();
        let records = s.load_records().unwrap();
        assert_eq!(records.len(), 2, "{records:?}");
        assert!(
            records
                .iter()
                .any(|r| matches!(r, Record::Counter(n, 7) if n == "offer"))
        );
        assert_eq!(s.next_seq("ad", 0).unwrap(), 3);
        assert_eq!(s.next_seq("ad", 100).unwrap(), 100);
        s.apply(
            &[
                RecordOp::Delete(RecordKey::Pass(k.address())),
                RecordOp::Delete(RecordKey::Counter("offer".into())),
            ],
            &k.address(),
        )
        .unwrap();
        assert!(s.load_records().unwrap().is_empty());
    }
}
