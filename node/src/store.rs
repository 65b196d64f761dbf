//! The node's store: one redb file under the data directory.
//!
//! redb rather than sled: sled 0.34 is beta, flushes with `sync_file_range` (no durability
//! guarantee) and has open reports of databases that will not open after an abrupt stop.
//! redb is ACID and durable when `commit` returns. See `docs/architecture.md`.
//!
//! What is kept: the market engine's records (`cannabis_market::Record`): the signed ads and
//! offers of the live view (re-verified when loaded), challenge passes other nodes signed
//! for this one (by verifier), the jobs this node published with their bids, leases and
//! epochs (JSON parts under the job id: a change writes only the parts it touched, see
//! [`cannabis_market::job::Part`]), the bids and leases it holds as a worker, and the sequence
//! counters (so a restart never reuses a sequence number); each batch the engine asks for
//! is one transaction. Beside them: the executor's attempt journal.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use anyhow::Context as _;
use cannabis_market::job::{Job, Part};
use cannabis_market::lease::AssignmentKey;
use cannabis_market::{Record, RecordKey, RecordOp};
use cannabis_protocol::{Digest, Uuid};
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

/// The ledger's blocks this node took, by height (the block's wire bytes).
const LEDGER_BLOCKS: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("ledger_blocks");
/// Transactions the sequencer acknowledged and has not put in a block yet, by id (the
/// signed transaction's wire bytes).
const LEDGER_POOL: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("ledger_pool");

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
        // A job is its parts: the key is the prefix of theirs (see `Store::put_job`).
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
    /// The parts of each job as last committed (their key within the job's and the digest
    /// of their bytes): a job's next write puts only the parts that differ and removes the
    /// ones gone. The empty key stands for a job kept whole, as before parts.
    written: Mutex<HashMap<Uuid, Written>>,
    /// Bytes of job parts written since the store was opened (committed or not).
    job_bytes: std::sync::atomic::AtomicU64,
}

/// A job's parts as committed: part key to the digest of its bytes.
type Written = HashMap<Vec<u8>, Digest>;

/// A job's key, then a part's.
fn part_key(job: &Uuid, part: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(16 + part.len());
    k.extend_from_slice(&job.0);
    k.extend_from_slice(part);
    k
}

/// Every stored row of a job (a part, or the whole job kept before parts).
fn job_rows(
    table: &impl redb::ReadableTable<&'static [u8], &'static [u8]>,
    job: &Uuid,
) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut keys = Vec::new();
    for row in table.range(job.0.as_slice()..)? {
        let (k, _) = row?;
        if !k.value().starts_with(&job.0) {
            break;
        }
        keys.push(k.value().to_vec());
    }
    Ok(keys)
}

/// The open database, for one operation.
struct Db<'a>(RwLockReadGuard<'a, Option<Database>>);

impl std::ops::Deref for Db<'_> {
    type Target = Database;
    fn deref(&self) -> &Database {
        self.0.as_ref().expect("checked when the guard was made")
    }
}

/// The store's page cache. redb's default (1 GiB) would let the cache of a busy node's
/// written pages grow to that; what the node reads back often is small (the market is in
/// memory), so a small cache costs nothing.
const CACHE_BYTES: usize = 32 << 20;

fn create(path: &Path) -> anyhow::Result<Database> {
    let db = redb::Builder::new()
        .set_cache_size(CACHE_BYTES)
        .create(path)
        .with_context(|| format!("opening the store at {}", path.display()))?;
    let txn = db.begin_write()?;
    txn.open_table(COUNTERS)?;
    for t in TABLES {
        txn.open_table(t)?;
    }
    txn.open_table(LEDGER_BLOCKS)?;
    txn.open_table(LEDGER_POOL)?;
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
            written: Mutex::new(HashMap::new()),
            job_bytes: std::sync::atomic::AtomicU64::new(0),
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
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        // What the jobs' parts will be once this commits (`None`: the job is gone).
        let mut now_written: Vec<(Uuid, Option<Written>)> = Vec::new();
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
                    RecordOp::Put(Record::Job(job)) => {
                        let mut table = txn.open_table(JOBS)?;
                        let id = job.id();
                        let before = now_written
                            .iter()
                            .rev()
                            .find(|(j, _)| *j == id)
                            .map(|(_, w)| w.as_ref())
                            .unwrap_or_else(|| written.get(&id));
                        let (parts, bytes) = put_job(&mut table, job, before)?;
                        self.job_bytes
                            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                        now_written.push((id, Some(parts)));
                    }
                    RecordOp::Delete(RecordKey::Job(id)) => {
                        let mut table = txn.open_table(JOBS)?;
                        for key in job_rows(&table, id)? {
                            table.remove(key.as_slice())?;
                        }
                        now_written.push((*id, None));
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
        for (id, parts) in now_written {
            match parts {
                Some(p) => written.insert(id, p),
                None => written.remove(&id),
            };
        }
        Ok(())
    }

    /// Bytes of job parts written since the store was opened.
    pub fn job_bytes_written(&self) -> u64 {
        self.job_bytes.load(std::sync::atomic::Ordering::Relaxed)
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
        let (jobs, bad_jobs) = load_jobs(&txn.open_table(JOBS)?)?;
        skipped += bad_jobs;
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        written.clear();
        for (job, parts) in jobs {
            written.insert(job.id(), parts);
            out.push(Record::Job(Box::new(job)));
        }
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

    /// Keeps block `height` and drops the transactions it holds (or that can never apply)
    /// from the pool, in one write: durable when this returns if `durable`, else with the
    /// next durable write (a crash before it loses the block, which the node fetches again
    /// from its peers: a block is the sequencer's to keep, durably; the others' copies can
    /// be fetched again, as sync does for gossip).
    pub fn put_block(
        &self,
        height: u64,
        block: &[u8],
        done: &[Digest],
        durable: bool,
    ) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        let db = self.db()?;
        let mut txn = db.begin_write()?;
        if !durable {
            txn.set_durability(redb::Durability::None)
                .context("writing a block without a sync")?;
        }
        txn.open_table(LEDGER_BLOCKS)?.insert(height, block)?;
        {
            let mut pool = txn.open_table(LEDGER_POOL)?;
            for id in done {
                pool.remove(id.0.as_slice())?;
            }
        }
        txn.commit()?;
        tracing::debug!(
            target: "cannabis::store",
            us = started.elapsed().as_micros() as u64,
            height,
            durable,
            "block write"
        );
        Ok(())
    }

    /// The blocks kept from height `from` on, in height order: at most `max` of them and,
    /// past the first, at most `max_bytes` in all.
    pub fn blocks(&self, from: u64, max: usize, max_bytes: usize) -> anyhow::Result<Vec<Vec<u8>>> {
        let db = self.db()?;
        let txn = db.begin_read()?;
        let table = txn.open_table(LEDGER_BLOCKS)?;
        let mut out: Vec<Vec<u8>> = Vec::new();
        let mut bytes = 0usize;
        for row in table.range(from..)?.take(max) {
            let (_, v) = row?;
            let v = v.value();
            if !out.is_empty() && bytes.saturating_add(v.len()) > max_bytes {
                break;
            }
            bytes = bytes.saturating_add(v.len());
            out.push(v.to_vec());
        }
        Ok(out)
    }

    /// Keeps a transaction for the next blocks; durable when this returns.
    pub fn put_pooled(&self, id: &Digest, tx: &[u8]) -> anyhow::Result<()> {
        let db = self.db()?;
        let txn = db.begin_write()?;
        txn.open_table(LEDGER_POOL)?.insert(id.0.as_slice(), tx)?;
        txn.commit()?;
        Ok(())
    }

    /// Keeps several transactions for the next blocks, in one durable write.
    pub fn put_pooled_many(&self, rows: &[(Digest, Vec<u8>)]) -> anyhow::Result<()> {
        let db = self.db()?;
        let txn = db.begin_write()?;
        {
            let mut table = txn.open_table(LEDGER_POOL)?;
            for (id, tx) in rows {
                table.insert(id.0.as_slice(), tx.as_slice())?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// The transactions kept for the next blocks.
    pub fn pooled(&self) -> anyhow::Result<Vec<Vec<u8>>> {
        let db = self.db()?;
        let txn = db.begin_read()?;
        let table = txn.open_table(LEDGER_POOL)?;
        table
            .iter()?
            .map(|row| Ok(row?.1.value().to_vec()))
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

/// Writes the parts of `job` that differ from what was written before (`before`), removes
/// those gone, and says what is written now and how many bytes it wrote.
fn put_job(
    table: &mut redb::Table<'_, &'static [u8], &'static [u8]>,
    job: &Job,
    before: Option<&Written>,
) -> anyhow::Result<(Written, u64)> {
    let id = job.id();
    let mut now = HashMap::new();
    let mut wrote = 0u64;
    for part in job.parts() {
        let key = part.key();
        let bytes = serde_json::to_vec(&part)?;
        let digest = Digest::of(&bytes);
        if before.and_then(|b| b.get(&key)) != Some(&digest) {
            table.insert(part_key(&id, &key).as_slice(), bytes.as_slice())?;
            wrote += bytes.len() as u64;
        }
        now.insert(key, digest);
    }
    match before {
        Some(b) => {
            for gone in b.keys().filter(|k| !now.contains_key(*k)) {
                table.remove(part_key(&id, gone).as_slice())?;
            }
        }
        // Not known to have been written (a new job, or one after a failed batch): any
        // other row under its id is stale.
        None => {
            for key in job_rows(table, &id)? {
                if !now.contains_key(&key[16..]) {
                    table.remove(key.as_slice())?;
                }
            }
        }
    }
    Ok((now, wrote))
}

/// The jobs kept, each with its parts as written, and how many rows or jobs did not
/// decode. A job kept whole (before parts) loads as it was; its next write replaces it by
/// parts.
fn load_jobs(
    table: &impl redb::ReadableTable<&'static [u8], &'static [u8]>,
) -> anyhow::Result<(Vec<(Job, Written)>, usize)> {
    let mut by_job: std::collections::BTreeMap<[u8; 16], (Vec<Part>, Option<Job>, Written)> =
        std::collections::BTreeMap::new();
    let mut skipped = 0;
    for row in table.iter()? {
        let (k, v) = row?;
        let (k, v) = (k.value(), v.value());
        let Some((id, part)) = k.split_first_chunk::<16>() else {
            skipped += 1;
            continue;
        };
        let entry = by_job.entry(*id).or_default();
        entry.2.insert(part.to_vec(), Digest::of(v));
        if part.is_empty() {
            match serde_json::from_slice::<Job>(v) {
                Ok(j) => entry.1 = Some(j),
                Err(_) => skipped += 1,
            }
        } else {
            match serde_json::from_slice::<Part>(v) {
                Ok(p) => entry.0.push(p),
                Err(_) => skipped += 1,
            }
        }
    }
    let mut jobs = Vec::with_capacity(by_job.len());
    for (id, (parts, whole, written)) in by_job {
        let job = match whole {
            Some(j) if parts.is_empty() => Ok(j),
            _ => Job::from_parts(parts),
        };
        match job {
            Ok(j) => jobs.push((j, written)),
            Err(e) => {
                tracing::warn!(job = %Uuid(id), error = %e, "a kept job does not load");
                skipped += 1;
            }
        }
    }
    Ok((jobs, skipped))
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
    use redb::ReadableTableMetadata as _;

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

    /// A job with 1,000 declines (the most reasons a record gathers is bounded only by the
    /// workers an offer draws): one more decline writes its own part, the head and a history
    /// line (about 1 KB), not the whole job again (about 600 KB, as it did before), after a
    /// restart too; what loads is the job as it was; a deleted job leaves no row.
    #[test]
    fn a_change_to_a_job_writes_only_the_parts_it_touched() {
        use cannabis_market::testkit;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.redb");
        let t = Timestamp(1_000_000);
        let me = testkit::keys(1).address();
        let mut job = testkit::job(me, vec![testkit::task("t", 1, 0, 0, 1, 1_000)], t);
        let decline = |job: &Job, i: u64| {
            let worker = testkit::keys(100 + i).address();
            testkit::decline(job, 0, worker, "no ".repeat(60), t)
        };
        for i in 0..1_000 {
            job.on_decline(decline(&job, i), t).unwrap();
        }
        let put = |s: &Store, j: &Job| {
            s.apply(&[RecordOp::Put(Record::Job(Box::new(j.clone())))], &me)
                .unwrap()
        };
        let json = |j: &Job| serde_json::to_string(j).unwrap();
        let s = Store::open(&path).unwrap();
        put(&s, &job);
        let whole = s.job_bytes_written();
        assert!(whole > 300_000, "{whole}");
        job.on_decline(decline(&job, 1_000), t).unwrap();
        put(&s, &job);
        let change = s.job_bytes_written() - whole;
        assert!(change < 4_096, "one decline wrote {change} bytes");
        // The same job again writes nothing.
        put(&s, &job);
        assert_eq!(s.job_bytes_written() - whole, change);
        drop(s);

        let s = Store::open(&path).unwrap();
        let loaded = s.load_records().unwrap();
        let [Record::Job(back)] = loaded.as_slice() else {
            panic!("{loaded:?}")
        };
        assert_eq!(json(back), json(&job));
        assert_eq!(back.history().len(), 1_000, "the history keeps its bound");
        job.on_decline(decline(&job, 1_001), t).unwrap();
        put(&s, &job);
        assert!(s.job_bytes_written() < 4_096, "{}", s.job_bytes_written());
        let loaded = s.load_records().unwrap();
        let [Record::Job(back)] = loaded.as_slice() else {
            panic!("{loaded:?}")
        };
        assert_eq!(json(back), json(&job));
        s.apply(&[RecordOp::Delete(RecordKey::Job(job.id()))], &me)
            .unwrap();
        assert!(s.load_records().unwrap().is_empty());
        assert!(
            s.db()
                .unwrap()
                .begin_read()
                .unwrap()
                .open_table(JOBS)
                .unwrap()
                .is_empty()
                .unwrap()
        );
    }

    /// A job kept whole, as nodes did before parts, loads as it was, and its next write
    /// replaces it by parts.
    #[test]
    fn a_job_kept_whole_loads_and_is_then_kept_in_parts() {
        use cannabis_market::testkit;

        let dir = tempfile::tempdir().unwrap();
        let t = Timestamp(1_000_000);
        let me = testkit::keys(1).address();
        let job = testkit::job(me, vec![testkit::task("t", 1, 0, 0, 1, 1_000)], t);
        let s = Store::open(&dir.path().join("node.redb")).unwrap();
        {
            let txn = s.db().unwrap().begin_write().unwrap();
            txn.open_table(JOBS)
                .unwrap()
                .insert(
                    job.id().0.as_slice(),
                    serde_json::to_vec(&job).unwrap().as_slice(),
                )
                .unwrap();
            txn.commit().unwrap();
        }
        let loaded = s.load_records().unwrap();
        assert!(matches!(loaded.as_slice(), [Record::Job(j)] if j.id() == job.id()));
        s.apply(&[RecordOp::Put(Record::Job(Box::new(job.clone())))], &me)
            .unwrap();
        let txn = s.db().unwrap().begin_read().unwrap();
        let table = txn.open_table(JOBS).unwrap();
        let keys: Vec<usize> = table
            .iter()
            .unwrap()
            .map(|r| r.unwrap().0.value().len())
            .collect();
        assert!(!keys.is_empty() && keys.iter().all(|&k| k > 16), "{keys:?}");
    }
}
