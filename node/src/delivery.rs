//! Outputs on their way back: the worker seals a completed attempt's outputs (each
//! encrypted with age to the requester's recipient, cut in transfer chunks under a Merkle
//! root) and serves them on the transfer protocol to that requester only; the requester
//! fetches them chunk by chunk (each checked against the signed manifest, resumable at
//! any chunk), decrypts, checks digests, sizes and tensor headers, and keeps them under
//! its data dir.
//!
//! On disk (beneath the node's data dir):
//! - `outbox/<job>-<task>-<rank>-<epoch>/`: `manifest.json` (who may fetch, what),
//!   `<name>.age` (the ciphertext) and `<name>.leaves` (its chunks' leaf hashes), written
//!   whole in a temporary folder and renamed into place; removed when the lease ends.
//! - `results/<job>/<task>/<rank>/<name>`: delivered outputs, checked; partial fetches in
//!   `results/<job>/<task>/<rank>/.fetch-<epoch>/<name>.age.part`, resumed after a restart.
//! - `outbox/ckpt-<job>-<task>-<rank>-<epoch>/<seq>.age` (and `.leaves`): a worker's
//!   sealed checkpoints of a running attempt, the last two; removed when the lease ends.
//! - `checkpoints/<job>/<task>-<rank>/<digest>`: a requester's kept checkpoints of a rank
//!   (the newest, and the one an award pins), checked; served to the rank's next worker.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr as _;

use cannabis_protocol::{
    Address, CheckpointNote, DeliveryIdentity, DeliveryManifest, DeliveryRecipient, Digest,
    NamedDigest, ObjectKind, ObjectRef, OutputDigest, TRANSFER_CHUNK, TransferRequest,
    TransferResponse, Uuid, max_cipher_size, merkle,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use cannabis_market::RunOrder;

use crate::exec::ExecutorHandle;

/// What a sealed delivery's folder says of itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Sealed {
    requester: Address,
    outputs: Vec<OutputDigest>,
}

/// The folder of one lease's sealed outputs, by the executor's request id.
fn outbox_dir(data_dir: &Path, request_id: &str) -> PathBuf {
    data_dir.join("outbox").join(request_id.replace('/', "-"))
}

/// Where a job's delivered outputs are kept.
pub fn results_dir(data_dir: &Path, job: &Uuid) -> PathBuf {
    data_dir.join("results").join(job.to_string())
}

/// The folder of one rank's delivered outputs.
pub fn rank_dir(data_dir: &Path, job: &Uuid, task: u32, rank: u32) -> PathBuf {
    results_dir(data_dir, job)
        .join(task.to_string())
        .join(rank.to_string())
}

/// A writer that hashes what goes through it as transfer-chunk leaves (the Merkle leaves
/// of the file it writes), so a sealed file is not read again to find them.
struct LeafWriter<W> {
    inner: W,
    leaves: Vec<Digest>,
    leaf: Sha256,
    in_leaf: u64,
}

impl<W: Write> LeafWriter<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            leaves: Vec::new(),
            leaf: Self::fresh(),
            in_leaf: 0,
        }
    }

    fn fresh() -> Sha256 {
        let mut h = Sha256::new();
        h.update([0u8]);
        h
    }

    /// The writer, and the leaves of everything written.
    fn finish(mut self) -> (W, Vec<Digest>) {
        if self.in_leaf > 0 {
            let done = std::mem::replace(&mut self.leaf, Self::fresh());
            self.leaves.push(Digest(done.finalize().into()));
        }
        (self.inner, self.leaves)
    }
}

impl<W: Write> Write for LeafWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = (TRANSFER_CHUNK - self.in_leaf) as usize;
        let n = self.inner.write(&buf[..buf.len().min(room)])?;
        self.leaf.update(&buf[..n]);
        self.in_leaf += n as u64;
        if self.in_leaf == TRANSFER_CHUNK {
            let done = std::mem::replace(&mut self.leaf, Self::fresh());
            self.leaves.push(Digest(done.finalize().into()));
            self.in_leaf = 0;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// How many bytes a pipeline stage hands on at a time.
const STAGE_BYTES: usize = 1 << 20;

/// Buffers handed on to the next stage of a pipeline of threads (bounded: a few
/// [`STAGE_BYTES`] in flight), and taken back from it empty, so the stages reuse a few
/// buffers instead of touching fresh memory for every step.
struct Handover {
    tx: std::sync::mpsc::SyncSender<Vec<u8>>,
    back: std::sync::mpsc::Receiver<Vec<u8>>,
    buf: Vec<u8>,
}

/// The receiving end of a [`Handover`]: each buffer, then back to the sender.
struct Taken {
    rx: std::sync::mpsc::Receiver<Vec<u8>>,
    back: std::sync::mpsc::Sender<Vec<u8>>,
}

/// A pipe between two stages.
fn handover() -> (Handover, Taken) {
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    let (back_tx, back) = std::sync::mpsc::channel();
    (
        Handover {
            tx,
            back,
            buf: Vec::with_capacity(STAGE_BYTES),
        },
        Taken { rx, back: back_tx },
    )
}

impl Handover {
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let fresh = self
            .back
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(STAGE_BYTES));
        self.tx
            .send(std::mem::replace(&mut self.buf, fresh))
            .map_err(|_| io::Error::other("the next stage stopped"))
    }
}

impl Write for Handover {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(STAGE_BYTES - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == STAGE_BYTES {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

impl Taken {
    /// Hands every buffer to `f` until the sender is gone (or `f` fails).
    fn each(self, mut f: impl FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
        for mut buf in self.rx {
            f(&buf)?;
            buf.clear();
            let _ = self.back.send(buf);
        }
        Ok(())
    }
}

/// Encrypts a reader's bytes to `to` into `out`, returning the plaintext's digest and
/// size and the ciphertext's transfer-chunk leaves; more than `cap` bytes is an error
/// (never a truncation). Three threads: one reads and hashes the plaintext, one encrypts,
/// one hashes the ciphertext's leaves and writes it, so a large output is sealed in
/// about the time of its slowest pass, not of all three.
fn encrypt(
    mut src: impl FnMut(u64) -> io::Result<(Vec<u8>, bool)> + Send,
    to: &DeliveryRecipient,
    out: &mut File,
    cap: u64,
    name: &str,
) -> Result<(Digest, u64, Vec<Digest>), String> {
    let recipient = age::x25519::Recipient::from_str(&to.to_string())
        .map_err(|e| format!("the requester's recipient is not an age key: {e}"))?;
    let encryptor =
        age::Encryptor::with_recipients(std::iter::once(&recipient as &dyn age::Recipient))
            .map_err(|e| format!("age: {e}"))?;
    let writing = |e: io::Error| format!("writing {name}: {e}");
    let (plain_tx, plain_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
    let (cipher, cipher_rx) = handover();
    std::thread::scope(|s| {
        let reader = s.spawn(move || {
            let mut hash = Sha256::new();
            let mut size = 0u64;
            loop {
                let (data, eof) = src(size).map_err(|e| format!("reading output {name:?}: {e}"))?;
                size += data.len() as u64;
                if size > cap {
                    return Err(format!(
                        "output {name:?} is over its max_size of {cap} bytes"
                    ));
                }
                hash.update(&data);
                let last = eof || data.is_empty();
                if plain_tx.send(data).is_err() || last {
                    break;
                }
            }
            Ok((Digest(hash.finalize().into()), size))
        });
        let writer = s.spawn(move || {
            let mut w = LeafWriter::new(io::BufWriter::with_capacity(1 << 20, &mut *out));
            cipher_rx.each(|buf| w.write_all(buf))?;
            let (mut buf, leaves) = w.finish();
            buf.flush()?;
            drop(buf);
            out.sync_all()?;
            Ok::<_, io::Error>(leaves)
        });
        let sealed = (|| {
            let mut w = encryptor.wrap_output(cipher)?;
            for data in plain_rx {
                w.write_all(&data)?;
            }
            w.finish()?.flush()
        })();
        // The reader's error first (it says why the bytes stopped), then the writer's.
        let (digest, size) = reader
            .join()
            .map_err(|_| "the reader panicked".to_string())??;
        let leaves = writer
            .join()
            .map_err(|_| "the writer panicked".to_string())?
            .map_err(writing)?;
        sealed.map_err(writing)?;
        Ok((digest, size, leaves))
    })
}

/// Reads until `buf` is full or the end.
fn read_full(f: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Encrypts one file's bytes to `to` (used by the worker's seal and by tests).
pub fn seal_bytes_to(
    data: &[u8],
    to: &DeliveryRecipient,
    out: &mut File,
) -> Result<(Digest, u64), String> {
    let mut done = false;
    let (digest, size, _) = encrypt(
        |_| {
            let chunk = if done { Vec::new() } else { data.to_vec() };
            done = true;
            Ok((chunk, true))
        },
        to,
        out,
        u64::MAX,
        "data",
    )?;
    Ok((digest, size))
}

/// What a lease's attempt delivers: which outputs, capped how, to whom.
pub struct SealOrder<'a> {
    pub request_id: &'a str,
    pub attempt: &'a str,
    pub outputs: Vec<(String, u64)>,
    pub requester: Address,
    pub to: DeliveryRecipient,
    /// A testnet fault (`cannabis testnet corrupt`): the first byte of every output is
    /// flipped before it is hashed and sealed, as a worker that fabricates results would
    /// (its manifest then pins the wrong bytes, and only a check of the content finds it).
    pub corrupt: bool,
}

/// Seals a completed attempt's outputs for its requester (once: a second call, after a
/// restart, finds them sealed). Blocking.
pub fn seal(
    data_dir: &Path,
    ex: &ExecutorHandle,
    order: &SealOrder<'_>,
) -> Result<Vec<OutputDigest>, String> {
    let dir = outbox_dir(data_dir, order.request_id);
    if let Ok(text) = fs::read(dir.join("manifest.json"))
        && let Ok(s) = serde_json::from_slice::<Sealed>(&text)
    {
        return Ok(s.outputs);
    }
    let io = |e: io::Error| format!("sealing outputs in {}: {e}", dir.display());
    let tmp = dir.with_extension("tmp");
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(io)?;
    let mut outputs = Vec::new();
    for (name, cap) in &order.outputs {
        let path = tmp.join(format!("{name}.age"));
        let mut file = File::create(&path).map_err(io)?;
        let (digest, size, leaves) = encrypt(
            |offset| {
                ex.read_output(
                    order.attempt,
                    name,
                    offset,
                    cannabis_runtime::exec::MAX_CHUNK,
                )
                .map(|c| {
                    let mut data = c.data;
                    if order.corrupt
                        && offset == 0
                        && let Some(b) = data.first_mut()
                    {
                        *b ^= 0xff;
                    }
                    (data, c.eof)
                })
                .map_err(|e| io::Error::other(e.to_string()))
            },
            &order.to,
            &mut file,
            *cap,
            name,
        )?;
        let bytes: Vec<u8> = leaves.iter().flat_map(|d| d.0).collect();
        fs::write(tmp.join(format!("{name}.leaves")), bytes).map_err(io)?;
        outputs.push(OutputDigest {
            name: name.clone(),
            digest,
            size_bytes: size,
            cipher_size: file.metadata().map_err(io)?.len(),
            cipher_root: merkle::root_of_hashes(&leaves),
        });
    }
    let sealed = Sealed {
        requester: order.requester,
        outputs: outputs.clone(),
    };
    let text = serde_json::to_vec_pretty(&sealed).map_err(|e| e.to_string())?;
    let mut f = File::create(tmp.join("manifest.json")).map_err(io)?;
    f.write_all(&text).map_err(io)?;
    f.sync_all().map_err(io)?;
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&tmp, &dir).map_err(io)?;
    Ok(outputs)
}

/// Removes a lease's sealed outputs and checkpoints (its lease ended).
pub fn unseal(data_dir: &Path, request_id: &str) {
    let _ = fs::remove_dir_all(outbox_dir(data_dir, request_id));
    let _ = fs::remove_dir_all(checkpoint_outbox(data_dir, request_id));
}

/// The folder of one lease's sealed checkpoints, by the executor's request id.
fn checkpoint_outbox(data_dir: &Path, request_id: &str) -> PathBuf {
    data_dir
        .join("outbox")
        .join(format!("ckpt-{}", request_id.replace('/', "-")))
}

/// How many sealed checkpoints a worker keeps per lease: the newest, and the one before
/// (which the requester may still be fetching).
const CHECKPOINTS_SEALED: u64 = 2;

/// Takes copy `copy.seq` of a running attempt's checkpoint, which the sandbox's monitor
/// sealed to the requester as it read it (its plaintext never leaves the sandbox), into
/// this lease's outbox as `<seq>.age` with its `.leaves`, and removes the ones before the
/// last [`CHECKPOINTS_SEALED`]. Returns its digests as the note gives them. Blocking.
pub fn take_checkpoint(
    data_dir: &Path,
    ex: &ExecutorHandle,
    request_id: &str,
    attempt: &str,
    copy: &cannabis_runtime::sandbox::CheckpointCopy,
    name: &str,
) -> Result<OutputDigest, String> {
    let seq = copy.seq;
    let dir = checkpoint_outbox(data_dir, request_id);
    let io = |e: io::Error| format!("taking checkpoint {seq} into {}: {e}", dir.display());
    fs::create_dir_all(&dir).map_err(io)?;
    let digest = Digest::from_hex(&copy.sha256)
        .map_err(|_| format!("checkpoint {seq}: its SHA-256 is not hex"))?;
    let tmp = dir.join(format!("{seq}.taking"));
    let file = File::create(&tmp).map_err(io)?;
    let mut w = LeafWriter::new(io::BufWriter::with_capacity(1 << 20, file));
    let sealed = format!("checkpoint/{seq}");
    let most = max_cipher_size(copy.size);
    let mut offset = 0u64;
    let taken = loop {
        let c = match ex.read_output(attempt, &sealed, offset, cannabis_runtime::exec::MAX_CHUNK) {
            Ok(c) => c,
            Err(e) => break Err(format!("reading checkpoint {seq}: {e}")),
        };
        offset += c.data.len() as u64;
        if offset > most {
            break Err(format!(
                "checkpoint {seq}: its age file is over what {} bytes make",
                copy.size
            ));
        }
        if let Err(e) = w.write_all(&c.data) {
            break Err(io(e));
        }
        if c.eof || c.data.is_empty() {
            break Ok(());
        }
    };
    let (buf, leaves) = w.finish();
    let file = buf.into_inner().map_err(|e| io(e.into_error()));
    let done = taken.and(file).and_then(|f| f.sync_all().map_err(io));
    if let Err(e) = done {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    let bytes: Vec<u8> = leaves.iter().flat_map(|d| d.0).collect();
    fs::write(dir.join(format!("{seq}.leaves")), bytes).map_err(io)?;
    fs::rename(&tmp, dir.join(format!("{seq}.age"))).map_err(io)?;
    // Older ones go (a fetch of one of them is refused, and the requester moves on to the
    // newest it was told of).
    if let Ok(entries) = fs::read_dir(&dir) {
        for e in entries.flatten() {
            let file = e.file_name();
            let old = file
                .to_str()
                .and_then(|n| n.split('.').next())
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n + CHECKPOINTS_SEALED <= seq);
            if old {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    Ok(OutputDigest {
        name: name.to_string(),
        digest,
        size_bytes: copy.size,
        cipher_size: offset,
        cipher_root: merkle::root_of_hashes(&leaves),
    })
}

/// Answers the requester's request for a sealed checkpoint of a lease (the caller checked
/// that it asks for a lease it granted, at that epoch). Blocking.
pub fn serve_checkpoint(data_dir: &Path, req: &TransferRequest, trees: &Trees) -> TransferResponse {
    let o = &req.object;
    let numbered =
        !o.name.is_empty() && o.name.len() <= 20 && o.name.bytes().all(|b| b.is_ascii_digit());
    let request_id = RunOrder::request_id(&(o.job_id, o.task, o.rank), o.epoch);
    let file = checkpoint_outbox(data_dir, &request_id).join(format!("{}.age", o.name));
    if !numbered || !file.exists() {
        return TransferResponse::Refused {
            reason: format!(
                "no checkpoint {:?} of job {} task {} rank {} at epoch {} here (a newer one replaced it, or the lease ended)",
                o.name, o.job_id, o.task, o.rank, o.epoch
            ),
        };
    }
    serve_chunk(&file, req.index, trees)
}

/// Where a requester keeps the checkpoints of one job's ranks.
pub fn job_checkpoints(data_dir: &Path, job: &Uuid) -> PathBuf {
    data_dir.join("checkpoints").join(job.to_string())
}

/// Where a requester keeps the checkpoints of one rank, each named by its digest.
pub fn checkpoint_dir(data_dir: &Path, job: &Uuid, task: u32, rank: u32) -> PathBuf {
    job_checkpoints(data_dir, job).join(format!("{task}-{rank}"))
}

/// Where a requester keeps one checkpoint of a rank.
pub fn checkpoint_path(
    data_dir: &Path,
    job: &Uuid,
    task: u32,
    rank: u32,
    digest: &Digest,
) -> PathBuf {
    checkpoint_dir(data_dir, job, task, rank).join(digest.to_string())
}

/// Fetches the checkpoint a note announces from its worker, each chunk checked, then
/// decrypts it and checks its digest and size into the rank's checkpoint folder.
pub async fn fetch_checkpoint<F, Fut>(
    data_dir: &Path,
    identity: &DeliveryIdentity,
    note: &CheckpointNote,
    ask: F,
) -> Result<PathBuf, FetchError>
where
    F: Fn(TransferRequest) -> Fut,
    Fut: std::future::Future<Output = Result<TransferResponse, String>>,
{
    let c = &note.checkpoint;
    let dir = checkpoint_dir(data_dir, &note.job_id, note.task, note.rank);
    let out = dir.join(c.digest.to_string());
    if out.exists() {
        return Ok(out);
    }
    let part = dir
        .join(".fetch")
        .join(format!("{}-{}.age.part", note.epoch, note.seq));
    fs::create_dir_all(dir.join(".fetch"))
        .map_err(|e| FetchError::Transient(format!("{}: {e}", dir.display())))?;
    let object = ObjectRef {
        job_id: note.job_id,
        task: note.task,
        rank: note.rank,
        epoch: note.epoch,
        kind: ObjectKind::Checkpoint,
        name: note.seq.to_string(),
    };
    let expect = Expect {
        known: Some((c.cipher_size, c.cipher_root)),
        max_plain: c.size_bytes,
    };
    let whole = fetch_object(&part, &object, expect, &ask, &mut |_, _| {}).await?;
    let check = Check {
        name: c.name.clone(),
        digest: c.digest,
        size: Some(c.size_bytes),
        max: c.size_bytes,
        content_rules: false,
    };
    let opened = open_checked(&whole, &out, check, identity).await;
    let _ = fs::remove_file(&whole);
    opened.map(|()| out)
}

/// Answers a request for an output from `from`. Blocking.
pub fn serve(
    data_dir: &Path,
    from: &Address,
    req: &TransferRequest,
    trees: &Trees,
) -> TransferResponse {
    let refuse = |reason: String| TransferResponse::Refused { reason };
    let o = &req.object;
    if o.kind != ObjectKind::Output || !cannabis_protocol::is_safe_name(&o.name) {
        return refuse("not an output of a delivery".into());
    }
    let request_id = RunOrder::request_id(&(o.job_id, o.task, o.rank), o.epoch);
    let dir = outbox_dir(data_dir, &request_id);
    let Some(sealed) = fs::read(dir.join("manifest.json"))
        .ok()
        .and_then(|t| serde_json::from_slice::<Sealed>(&t).ok())
    else {
        return refuse(format!(
            "no delivery of job {} task {} rank {} at epoch {} here",
            o.job_id, o.task, o.rank, o.epoch
        ));
    };
    if sealed.requester != *from {
        return refuse("only the requester of this delivery may fetch it".into());
    }
    if !sealed.outputs.iter().any(|d| d.name == o.name) {
        return refuse(format!("this delivery has no output {:?}", o.name));
    }
    serve_chunk(&dir.join(format!("{}.age", o.name)), req.index, trees)
}

/// The Merkle trees of the sealed files served lately, so that each chunk's proof is a
/// look-up instead of a pass over every leaf of the file (`O(n)` per chunk, `O(n^2)` per
/// file: minutes for a file of a few GiB). A few files at a time; a file is known by its
/// leaves file's path, inode, size and modification time, so one sealed again is read
/// again.
#[derive(Default)]
pub struct Trees(std::sync::Mutex<Vec<(TreeKey, std::sync::Arc<merkle::Tree>)>>);

type TreeKey = (PathBuf, u64, u64, std::time::SystemTime);

/// Trees kept: about as many files as are fetched from one node at once.
const TREES_KEPT: usize = 8;

impl Trees {
    fn kept(&self) -> std::sync::MutexGuard<'_, Vec<(TreeKey, std::sync::Arc<merkle::Tree>)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn of(&self, leaves_file: &Path) -> io::Result<std::sync::Arc<merkle::Tree>> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = fs::metadata(leaves_file)?;
        let key = (
            leaves_file.to_path_buf(),
            meta.ino(),
            meta.len(),
            meta.modified()?,
        );
        if let Some((_, tree)) = self.kept().iter().find(|(k, _)| *k == key) {
            return Ok(tree.clone());
        }
        let bytes = fs::read(leaves_file)?;
        let leaves: Vec<Digest> = bytes
            .chunks_exact(32)
            .map(|c| Digest(c.try_into().unwrap_or([0; 32])))
            .collect();
        let tree = std::sync::Arc::new(merkle::Tree::from_leaf_hashes(leaves));
        let mut kept = self.kept();
        kept.retain(|(k, _)| k.0 != key.0);
        kept.insert(0, (key, tree.clone()));
        kept.truncate(TREES_KEPT);
        Ok(tree)
    }
}

/// One chunk of a sealed age file (beside it, its `.leaves`), with its proof.
fn serve_chunk(age_file: &Path, index: u64, trees: &Trees) -> TransferResponse {
    let refuse = |reason: String| TransferResponse::Refused { reason };
    let read = || -> io::Result<TransferResponse> {
        let tree = trees.of(&age_file.with_extension("leaves"))?;
        let Some(proof) = usize::try_from(index).ok().and_then(|i| tree.prove(i)) else {
            return Ok(refuse(format!(
                "chunk {index} is past the end ({} chunks)",
                tree.size()
            )));
        };
        let mut f = File::open(age_file)?;
        let size = f.metadata()?.len();
        f.seek(SeekFrom::Start(index * TRANSFER_CHUNK))?;
        let mut data = vec![0u8; TRANSFER_CHUNK as usize];
        let n = read_full(&mut f, &mut data)?;
        data.truncate(n);
        Ok(TransferResponse::Chunk {
            index,
            size,
            root: tree.root(),
            data,
            proof: proof.path,
        })
    };
    read().unwrap_or_else(|e| refuse(format!("reading it: {e}")))
}

/// Encrypts a local file to `to` as `<dir>/<file>.age` (with its `.leaves`), once.
fn seal_file(
    source: &Path,
    pinned: &Digest,
    to: &DeliveryRecipient,
    age_file: &Path,
) -> Result<(), String> {
    if age_file.exists() && age_file.with_extension("leaves").exists() {
        return Ok(());
    }
    let io = |e: io::Error| format!("sealing {}: {e}", source.display());
    let dir = age_file.parent().ok_or("no folder")?;
    fs::create_dir_all(dir).map_err(io)?;
    let tmp = age_file.with_extension("sealing");
    let mut out = File::create(&tmp).map_err(io)?;
    let mut src = File::open(source).map_err(io)?;
    let mut buf = vec![0u8; 1 << 20];
    let (digest, _, leaves) = encrypt(
        |_| {
            let n = read_full(&mut src, &mut buf)?;
            Ok((buf[..n].to_vec(), n < buf.len()))
        },
        to,
        &mut out,
        u64::MAX,
        &source.display().to_string(),
    )?;
    if digest != *pinned {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "the copy kept for it changed since the job was published (digest {digest}, pinned {pinned})"
        ));
    }
    let bytes: Vec<u8> = leaves.iter().flat_map(|d| d.0).collect();
    fs::write(age_file.with_extension("leaves"), bytes).map_err(io)?;
    fs::rename(&tmp, age_file).map_err(io)
}

/// Where a requester keeps a package (a bundle or a staged input) by digest: `job
/// submit` copies it there.
pub fn package_path(data_dir: &Path, digest: &Digest) -> PathBuf {
    data_dir.join("packages").join(digest.to_string())
}

/// Copies a local file into the package store (checked on the copy); returns its
/// digest and size.
pub fn keep_package(data_dir: &Path, source: &Path) -> Result<(Digest, u64), String> {
    let io = |e: io::Error| format!("keeping {} for workers to fetch: {e}", source.display());
    let dir = data_dir.join("packages");
    fs::create_dir_all(&dir).map_err(io)?;
    let tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io)?;
    let mut src = File::open(source).map_err(io)?;
    let mut w = io::BufWriter::new(tmp.as_file());
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = src.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        w.write_all(&buf[..n]).map_err(io)?;
        size += n as u64;
    }
    w.flush().map_err(io)?;
    drop(w);
    tmp.as_file().sync_all().map_err(io)?;
    let digest = Digest(hash.finalize().into());
    tmp.persist(package_path(data_dir, &digest))
        .map_err(|e| io(e.error))?;
    Ok((digest, size))
}

/// What a requester serves a worker: a package of a rank it awarded.
pub struct PackageServe {
    /// The assignment's executor request id (job, task, rank, epoch).
    pub request_id: String,
    /// The plaintext it is made from.
    pub source: PathBuf,
    /// Its pinned digest.
    pub digest: Digest,
    /// The worker's recipient, from its ad.
    pub to: DeliveryRecipient,
}

/// Answers a request for a package, sealing it first if this is its first request.
/// Blocking; `lock` keeps two requests from sealing one package at once.
pub fn serve_package(
    data_dir: &Path,
    p: &PackageServe,
    req: &TransferRequest,
    lock: &std::sync::Mutex<()>,
    trees: &Trees,
) -> TransferResponse {
    let kind = match req.object.kind {
        ObjectKind::Bundle => "bundle",
        ObjectKind::Input => "input",
        ObjectKind::Output => "output",
        ObjectKind::Checkpoint => "checkpoint",
    };
    let age_file = data_dir
        .join("outbox")
        .join(format!("pkg-{}", p.request_id.replace('/', "-")))
        .join(format!("{kind}-{}.age", req.object.name));
    let sealed = {
        let _held = lock.lock();
        seal_file(&p.source, &p.digest, &p.to, &age_file)
    };
    match sealed {
        Ok(()) => serve_chunk(&age_file, req.index, trees),
        Err(e) => TransferResponse::Refused { reason: e },
    }
}

/// Removes what a requester sealed for one assignment's epoch.
pub fn unseal_packages(data_dir: &Path, request_id: &str) {
    let _ = fs::remove_dir_all(
        data_dir
            .join("outbox")
            .join(format!("pkg-{}", request_id.replace('/', "-"))),
    );
}

/// Why a fetch did not give checked outputs.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Worth another try later (the worker is unreachable, a request timed out).
    #[error("{0}")]
    Transient(String),
    /// The delivery is bad: it will not get better by asking again.
    #[error("{0}")]
    Bad(String),
}

impl FetchError {
    /// What a fetch that gave up after `patience` says: a bad delivery's own reason, or
    /// `what` ("not fetched") for how long, and the last transient error.
    pub fn after(self, patience: std::time::Duration, what: &str) -> String {
        match self {
            Self::Bad(why) => why,
            Self::Transient(why) => format!("{what} in {} s: {why}", patience.as_secs()),
        }
    }
}

/// Calls `attempt` until it gives a result or a [`FetchError::Bad`], or until `patience`
/// has passed since the first call: after each transient failure it waits `first`, then
/// twice as long each time, at most `most`. What a transfer's peer being away for a while
/// looks like to every fetch: it resumes where it was.
pub async fn patiently<T, F, Fut>(
    patience: std::time::Duration,
    first: std::time::Duration,
    most: std::time::Duration,
    mut attempt: F,
) -> Result<T, FetchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, FetchError>>,
{
    let started = tokio::time::Instant::now();
    let mut pause = first;
    loop {
        match attempt().await {
            Err(FetchError::Transient(why)) if started.elapsed() < patience => {
                tracing::debug!(reason = %why, "transfer interrupted; resuming");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(most);
            }
            other => return other,
        }
    }
}

/// How many times a chunk that fails its check is asked for again before the delivery
/// counts as bad.
const CHUNK_RETRIES: u32 = 3;

/// What a fetcher knows of an object before it asks.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    /// Size and Merkle root, when signed for (an output's, from its manifest); `None`:
    /// the first chunk says, and every later one is held to it.
    pub known: Option<(u64, Digest)>,
    /// The most plaintext the object may hold (its age file is refused past what that
    /// makes).
    pub max_plain: u64,
}

/// The size and root a fetch took from the first chunk, kept beside the partial file so a
/// resumed fetch holds the rest to them.
#[derive(Serialize, Deserialize)]
struct Learned {
    size: u64,
    root: Digest,
}

/// Fetches one object's age file into `part` (renamed to `part` less `.part` once whole),
/// each chunk checked, resuming at the first chunk missing. Returns the whole file.
pub async fn fetch_object<F, Fut>(
    part: &Path,
    object: &ObjectRef,
    expect: Expect,
    ask: &F,
    progress: &mut impl FnMut(u64, u64),
) -> Result<PathBuf, FetchError>
where
    F: Fn(TransferRequest) -> Fut,
    Fut: std::future::Future<Output = Result<TransferResponse, String>>,
{
    use futures::stream::{FuturesOrdered, StreamExt as _};
    let whole = part.with_extension("");
    if whole.exists() {
        return Ok(whole);
    }
    let io = |e: io::Error| FetchError::Transient(format!("writing {}: {e}", part.display()));
    let name = &object.name;
    let learned_path = part.with_extension("learned");
    let mut known = expect.known.or_else(|| {
        fs::read(&learned_path)
            .ok()
            .and_then(|t| serde_json::from_slice::<Learned>(&t).ok())
            .map(|l| (l.size, l.root))
    });
    fs::create_dir_all(part.parent().unwrap_or(Path::new("."))).map_err(io)?;
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(part)
        .map_err(io)?;
    // The leaf hash of every chunk kept, beside the part file. Neither is synced: a fetch
    // is on its way, and what is made durable is the checked plaintext it becomes. So a
    // resumed fetch hashes the chunks kept again and keeps them only as far as they match
    // (after a crash of the machine, the tail of either file may be lost or torn).
    let kept_path = part.with_extension("kept");
    let have = if known.is_some() {
        let whole = file.metadata().map_err(io)?.len() / TRANSFER_CHUNK;
        let kept = fs::read(&kept_path).unwrap_or_default();
        matching_prefix(&mut file, &kept, whole).map_err(io)?
    } else {
        0
    };
    file.set_len(have * TRANSFER_CHUNK).map_err(io)?;
    let file = std::sync::Arc::new(file);
    let mut kept_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&kept_path)
        .map_err(io)?;
    kept_file.set_len(have * 32).map_err(io)?;
    kept_file.seek(SeekFrom::End(0)).map_err(io)?;
    let max_cipher = cannabis_protocol::max_cipher_size(expect.max_plain);
    // One chunk asked for, then checked against the root its answer names and written in
    // its place, off the async thread (hashing and writing a large file there would hold
    // up every other message of the node). A chunk is written only once checked, so
    // whatever is in the part file at a chunk's place is that chunk or nothing.
    let take = |index: u64, known: Option<(u64, Digest)>| {
        let answer = ask(TransferRequest {
            object: object.clone(),
            index,
        });
        let file = file.clone();
        async move {
            let (size, root, data, proof) = match answer.await.map_err(FetchError::Transient)? {
                TransferResponse::Chunk {
                    index: i,
                    size,
                    root,
                    data,
                    proof,
                } if i == index => (size, root, data, proof),
                TransferResponse::Chunk { .. } => {
                    return Err(FetchError::Bad(format!(
                        "{name:?}: the peer sent another chunk than asked"
                    )));
                }
                TransferResponse::Refused { reason } => {
                    return Err(FetchError::Bad(format!("{name:?} refused: {reason}")));
                }
            };
            match known {
                Some(k) if k != (size, root) => {
                    return Err(FetchError::Bad(format!(
                        "{name:?}: the peer sent a chunk of another file ({size} bytes, root {root})"
                    )));
                }
                None if size > max_cipher => {
                    return Err(FetchError::Bad(format!(
                        "{name:?} is {size} bytes of ciphertext, over what {} bytes allow",
                        expect.max_plain
                    )));
                }
                _ => {}
            }
            tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt as _;
                let expected = size
                    .saturating_sub(index * TRANSFER_CHUNK)
                    .min(TRANSFER_CHUNK);
                let leaf = merkle::leaf_hash(&data);
                let good = data.len() as u64 == expected
                    && merkle::InclusionProof {
                        index,
                        tree_size: size.div_ceil(TRANSFER_CHUNK),
                        path: proof,
                    }
                    .verify_leaf_hash(&leaf, &root)
                    .is_ok();
                if good {
                    file.write_all_at(&data, index * TRANSFER_CHUNK)?;
                }
                Ok::<_, io::Error>(Checked {
                    size,
                    root,
                    leaf,
                    good,
                })
            })
            .await
            .map_err(|e| FetchError::Transient(e.to_string()))?
            .map_err(|e| FetchError::Transient(format!("writing {}: {e}", part.display())))
        }
    };
    /// What became of one chunk.
    struct Checked {
        size: u64,
        root: Digest,
        leaf: Digest,
        good: bool,
    }
    // A window of chunks in flight, taken in order: bounded memory (4 MiB), whatever the
    // size; wide enough that neither side waits on the other's round trip.
    const WINDOW: u64 = 16;
    let chunks_of = |size: u64| size.div_ceil(TRANSFER_CHUNK);
    let mut chunks = known.map_or(1, |(size, _)| chunks_of(size));
    let mut next = have;
    let mut inflight = FuturesOrdered::new();
    let mut retries = 0;
    let mut index = have;
    progress(have * TRANSFER_CHUNK, known.map_or(0, |k| k.0));
    // Until the first chunk tells the size, one request at a time.
    let window = if known.is_some() { WINDOW } else { 1 };
    while next < chunks && (inflight.len() as u64) < window {
        inflight.push_back(take(next, known));
        next += 1;
    }
    while let Some(checked) = inflight.next().await {
        let Checked {
            size,
            root,
            leaf,
            good,
        } = checked?;
        if known.is_none() {
            let text = serde_json::to_vec(&Learned { size, root })
                .map_err(|e| FetchError::Transient(e.to_string()))?;
            fs::write(&learned_path, text).map_err(io)?;
            known = Some((size, root));
            chunks = chunks_of(size);
        }
        if good {
            kept_file.write_all(&leaf.0).map_err(io)?;
            index += 1;
            progress((index * TRANSFER_CHUNK).min(size), size);
        } else {
            // A corrupted chunk: ask again, from it on.
            retries += 1;
            if retries > CHUNK_RETRIES {
                return Err(FetchError::Bad(format!(
                    "{name:?}: chunk {index} failed its check {retries} times"
                )));
            }
            tracing::warn!(%name, index, "a chunk failed its check: fetched again");
            inflight = FuturesOrdered::new();
            next = index;
        }
        while next < chunks && (inflight.len() as u64) < WINDOW {
            inflight.push_back(take(next, known));
            next += 1;
        }
    }
    fs::rename(part, &whole).map_err(io)?;
    let _ = fs::remove_file(&learned_path);
    let _ = fs::remove_file(&kept_path);
    Ok(whole)
}

/// How many of the first `whole` chunks of `file` still hash to the leaves `kept` lists.
fn matching_prefix(file: &mut File, kept: &[u8], whole: u64) -> io::Result<u64> {
    file.seek(SeekFrom::Start(0))?;
    let mut buf = vec![0u8; TRANSFER_CHUNK as usize];
    let mut n = 0;
    for leaf in kept
        .chunks_exact(32)
        .take(usize::try_from(whole).unwrap_or(usize::MAX))
    {
        if read_full(file, &mut buf)? < buf.len() || merkle::leaf_hash(&buf).0 != leaf {
            break;
        }
        n += 1;
    }
    Ok(n)
}

/// The partial age file of one output of a fetch.
fn part_path(dir: &Path, epoch: u64, name: &str) -> PathBuf {
    dir.join(format!(".fetch-{epoch}"))
        .join(format!("{name}.age.part"))
}

/// Fetches, checks and keeps a delivery's outputs; `ask` sends one transfer request to the
/// worker. Resumes from what an earlier try left. Returns the outputs' digests by name.
pub async fn fetch<F, Fut>(
    data_dir: &Path,
    identity: &DeliveryIdentity,
    m: &DeliveryManifest,
    ask: F,
    mut progress: impl FnMut(u64, u64),
) -> Result<Vec<NamedDigest>, FetchError>
where
    F: Fn(TransferRequest) -> Fut,
    Fut: std::future::Future<Output = Result<TransferResponse, String>>,
{
    let dir = rank_dir(data_dir, &m.job_id, m.task, m.rank);
    let total: u64 = m.outputs.iter().map(|o| o.cipher_size).sum();
    let mut before = 0u64;
    let mut kept = Vec::new();
    for o in &m.outputs {
        let object = ObjectRef {
            job_id: m.job_id,
            task: m.task,
            rank: m.rank,
            epoch: m.epoch,
            kind: ObjectKind::Output,
            name: o.name.clone(),
        };
        let expect = Expect {
            known: Some((o.cipher_size, o.cipher_root)),
            max_plain: o.size_bytes,
        };
        let part = part_path(&dir, m.epoch, &o.name);
        let check = Check {
            name: o.name.clone(),
            digest: o.digest,
            size: Some(o.size_bytes),
            max: o.size_bytes,
            content_rules: true,
        };
        let out = dir.join(&o.name);
        // Decrypted and checked while it arrives, from the chunks already checked and
        // written: the transfer and the decryption overlap.
        let arrival = Arrival::new(part.clone(), o.cipher_size);
        let opener = {
            let arrived = Arrived {
                arrival: arrival.clone(),
                file: None,
                pos: 0,
            };
            let (out, identity) = (out.clone(), identity.clone());
            tokio::task::spawn_blocking(move || {
                open_and_check_from(arrived, &out, &check, &identity)
            })
        };
        let fetched = fetch_object(&part, &object, expect, &ask, &mut |done, _| {
            arrival.written(done);
            progress(before + done, total)
        })
        .await;
        let whole = match fetched {
            // (Also when it was whole before: a fetch ended by a restart after the rename.)
            Ok(whole) => {
                arrival.written(o.cipher_size);
                whole
            }
            Err(e) => {
                arrival.abandon();
                let _ = opener.await;
                return Err(e);
            }
        };
        before += o.cipher_size;
        let opened = opener
            .await
            .map_err(|e| FetchError::Transient(e.to_string()))
            .and_then(|r| r);
        if let Err(e) = opened {
            // A file that fails is fetched afresh by the next try.
            let _ = fs::remove_file(&whole);
            return Err(e);
        }
        kept.push(NamedDigest {
            name: o.name.clone(),
            digest: o.digest,
        });
    }
    let _ = fs::remove_dir_all(dir.join(format!(".fetch-{}", m.epoch)));
    Ok(kept)
}

/// How far a fetch has come: the bytes of its part file checked and written so far, and
/// whether it was abandoned. The fetch moves it on; an [`Arrived`] reads behind it.
struct Arrival {
    part: PathBuf,
    total: u64,
    state: std::sync::Mutex<(u64, bool)>,
    more: std::sync::Condvar,
}

impl Arrival {
    fn new(part: PathBuf, total: u64) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            part,
            total,
            state: std::sync::Mutex::new((0, false)),
            more: std::sync::Condvar::new(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (u64, bool)> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The fetch has checked and written the first `bytes`.
    fn written(&self, bytes: u64) {
        let mut s = self.state();
        s.0 = s.0.max(bytes);
        self.more.notify_all();
    }

    /// The fetch ended without the whole file.
    fn abandon(&self) {
        self.state().1 = true;
        self.more.notify_all();
    }

    /// Waits until more than `at` bytes are in: how many, or an error once abandoned.
    fn past(&self, at: u64) -> io::Result<u64> {
        let mut s = self.state();
        while s.0 <= at && !s.1 {
            s = self
                .more
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        if s.0 <= at {
            return Err(io::Error::other(
                "the fetch ended before the whole file came",
            ));
        }
        Ok(s.0)
    }
}

/// An age file as it arrives: reads the bytes its fetch has checked and written, waiting
/// for more until the whole file is there.
struct Arrived {
    arrival: std::sync::Arc<Arrival>,
    file: Option<File>,
    pos: u64,
}

impl Read for Arrived {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let a = &self.arrival;
        if self.pos >= a.total {
            return Ok(0);
        }
        let ready = a.past(self.pos)?;
        let file = match &mut self.file {
            Some(f) => f,
            // The fetch renames the part file once it is whole.
            None => self
                .file
                .insert(File::open(&a.part).or_else(|_| File::open(a.part.with_extension("")))?),
        };
        let want = buf
            .len()
            .min(usize::try_from(ready - self.pos).unwrap_or(usize::MAX));
        let n = file.read(&mut buf[..want])?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// What a decrypted file must be.
pub struct Check {
    /// Its name (for errors, and the content rules).
    pub name: String,
    /// Its SHA-256.
    pub digest: Digest,
    /// Its size, when pinned.
    pub size: Option<u64>,
    /// The most bytes it may have.
    pub max: u64,
    /// Whether the rules for delivered outputs apply (no pickle, valid safetensors).
    pub content_rules: bool,
}

/// Decrypts a whole age file into `out` and checks it, off the async threads; a file that
/// fails is removed (a new try fetches afresh).
pub async fn open_checked(
    age_file: &Path,
    out: &Path,
    check: Check,
    identity: &DeliveryIdentity,
) -> Result<(), FetchError> {
    let (age_file, out, identity) = (age_file.to_path_buf(), out.to_path_buf(), identity.clone());
    tokio::task::spawn_blocking(move || {
        let r = open_and_check(&age_file, &out, &check, &identity);
        if r.is_err() {
            let _ = fs::remove_file(&age_file);
        }
        r
    })
    .await
    .map_err(|e| FetchError::Transient(e.to_string()))?
}

/// Decrypts an age file into `out` (through a temporary file), checking the plaintext's
/// digest and size, and for outputs the content rules.
fn open_and_check(
    age_file: &Path,
    out: &Path,
    c: &Check,
    identity: &DeliveryIdentity,
) -> Result<(), FetchError> {
    let src = File::open(age_file).map_err(|e| FetchError::Bad(format!("{:?}: {e}", c.name)))?;
    open_and_check_from(src, out, c, identity)
}

/// [`open_and_check`] of the age file `src` reads.
fn open_and_check_from(
    src: impl Read,
    out: &Path,
    c: &Check,
    identity: &DeliveryIdentity,
) -> Result<(), FetchError> {
    let bad = |why: String| FetchError::Bad(format!("{:?}: {why}", c.name));
    let secret = identity.to_age_string();
    let id = age::x25519::Identity::from_str(&secret).map_err(|e| bad(e.to_string()))?;
    let decryptor = age::Decryptor::new(io::BufReader::with_capacity(1 << 20, src))
        .map_err(|e| bad(format!("not an age file: {e}")))?;
    let mut reader = decryptor
        .decrypt(std::iter::once(&id as &dyn age::Identity))
        .map_err(|e| {
            bad(format!(
                "cannot be decrypted with this node's identity: {e}"
            ))
        })?;
    if let Some(parent) = out.parent() {
        fs::create_dir_all(parent).map_err(|e| bad(e.to_string()))?;
    }
    let tmp = out.with_extension("checking");
    let w = File::create(&tmp).map_err(|e| bad(e.to_string()))?;
    let result = (|| {
        // Decrypted here; hashed and written on another thread, so the two overlap.
        let (mut plain, plain_rx) = handover();
        let (digest, size) = std::thread::scope(|s| {
            let keeper = s.spawn(move || {
                let mut w = w;
                let mut hash = Sha256::new();
                plain_rx.each(|buf| {
                    hash.update(buf);
                    w.write_all(buf)
                })?;
                w.sync_all()?;
                Ok::<_, io::Error>(Digest(hash.finalize().into()))
            });
            let mut size = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            let read = (|| {
                loop {
                    let n = reader
                        .read(&mut buf)
                        .map_err(|e| bad(format!("tampered or truncated ciphertext: {e}")))?;
                    if n == 0 {
                        break;
                    }
                    size += n as u64;
                    if size > c.max {
                        return Err(bad(format!("more than its {} bytes", c.max)));
                    }
                    plain.write_all(&buf[..n]).map_err(|e| bad(e.to_string()))?;
                }
                plain.flush().map_err(|e| bad(e.to_string()))
            })();
            drop(plain);
            let kept = keeper
                .join()
                .map_err(|_| bad("the writer panicked".into()))?
                .map_err(|e| bad(e.to_string()))?;
            // (The writer's error first: a full disk stops the decryption too.)
            read?;
            Ok((kept, size))
        })?;
        if c.size.is_some_and(|s| s != size) || digest != c.digest {
            return Err(bad(format!(
                "decrypted to {size} bytes with digest {digest}, pinned {} with {}",
                c.size.map_or("any size".into(), |s| format!("{s} bytes")),
                c.digest
            )));
        }
        if c.content_rules {
            check_content(&c.name, &tmp).map_err(bad)?;
        }
        fs::rename(&tmp, out).map_err(|e| bad(e.to_string()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The content rules every delivered output passes: no pickle, whatever its name (a
/// pickle runs code when loaded), and a `*.safetensors` file's header is valid.
pub fn check_content(name: &str, path: &Path) -> Result<(), String> {
    let mut f = File::open(path).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    let mut head = vec![0u8; 64 * 1024];
    let n = read_full(&mut f, &mut head).map_err(|e| e.to_string())?;
    head.truncate(n);
    let mut last = [0u8; 1];
    if len > 0 {
        f.seek(SeekFrom::End(-1)).map_err(|e| e.to_string())?;
        f.read_exact(&mut last).map_err(|e| e.to_string())?;
    }
    if is_pickle(&head, last[0]) {
        return Err("a pickle file (it would run code when loaded): refused".into());
    }
    if name.ends_with(".safetensors") {
        f.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
        check_safetensors(&mut f, len)?;
    }
    Ok(())
}

/// Whether bytes are a pickle: protocol 2 to 5 (`0x80 n` ... `.`), or a PyTorch zip
/// archive (its `data.pkl` member).
fn is_pickle(head: &[u8], last: u8) -> bool {
    let raw = head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1]) && last == b'.';
    let torch_zip = head.starts_with(b"PK\x03\x04") && head.windows(8).any(|w| w == b"data.pkl");
    raw || torch_zip
}

/// Largest safetensors header read (the format's own bound).
const SAFETENSORS_HEADER_MAX: u64 = 100 * 1024 * 1024;

/// Checks a safetensors file's header: its length in bounds, JSON, known dtypes, each
/// tensor's byte range as long as its shape says, inside the file, no two overlapping,
/// and together covering the data exactly.
pub fn check_safetensors(f: &mut impl Read, len: u64) -> Result<(), String> {
    safetensors_tensors(f, len).map(|_| ())
}

/// The tensors of a safetensors file (name, dtype, shape) once it passes the checks of
/// [`check_safetensors`].
pub fn safetensors_tensors(
    f: &mut impl Read,
    len: u64,
) -> Result<Vec<(String, String, Vec<u64>)>, String> {
    let bad = |why: String| Err(format!("not a valid safetensors file: {why}"));
    let mut n = [0u8; 8];
    if len < 8 || f.read_exact(&mut n).is_err() {
        return bad("shorter than its 8-byte header length".into());
    }
    let n = u64::from_le_bytes(n);
    if n > SAFETENSORS_HEADER_MAX || n > len - 8 {
        return bad(format!("a header of {n} bytes in a file of {len}"));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| e.to_string())?;
    let json: serde_json::Map<String, serde_json::Value> = match serde_json::from_slice(&header) {
        Ok(j) => j,
        Err(e) => return bad(format!("the header is not a JSON object: {e}")),
    };
    let data_len = len - 8 - n;
    let mut ranges = Vec::new();
    let mut tensors = Vec::new();
    for (key, v) in &json {
        if key == "__metadata__" {
            if !v
                .as_object()
                .is_some_and(|m| m.values().all(|x| x.is_string()))
            {
                return bad("__metadata__ is not a map of strings".into());
            }
            continue;
        }
        let Some(t) = v.as_object() else {
            return bad(format!("tensor {key:?} is not an object"));
        };
        let dtype = t.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        let Some(width) = dtype_bits(dtype) else {
            return bad(format!("tensor {key:?} has unknown dtype {dtype:?}"));
        };
        let shape: Option<Vec<u64>> = t
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect());
        let Some(shape) = shape else {
            return bad(format!("tensor {key:?} has no shape of whole numbers"));
        };
        let offsets: Option<Vec<u64>> = t
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect());
        let Some([begin, end]) = offsets
            .as_deref()
            .and_then(|o| <[u64; 2]>::try_from(o).ok())
        else {
            return bad(format!("tensor {key:?} has no [begin, end] data_offsets"));
        };
        let bits = shape
            .iter()
            .try_fold(width, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("tensor {key:?}: its shape overflows"))?;
        if end < begin || end > data_len {
            return bad(format!(
                "tensor {key:?}: bytes {begin}..{end} are outside the {data_len} bytes of data"
            ));
        }
        if bits % 8 != 0 || bits / 8 != end - begin {
            return bad(format!(
                "tensor {key:?}: shape {shape:?} of {dtype} is not {} bytes",
                end - begin
            ));
        }
        ranges.push((begin, end, key.clone()));
        tensors.push((key.clone(), dtype.to_string(), shape));
    }
    ranges.sort();
    let mut at = 0;
    for (begin, end, key) in &ranges {
        if *begin < at {
            return bad(format!("tensor {key:?} overlaps another"));
        }
        if *begin > at {
            return bad(format!("bytes {at}..{begin} belong to no tensor"));
        }
        at = *end;
    }
    if at != data_len {
        return bad(format!("bytes {at}..{data_len} belong to no tensor"));
    }
    Ok(tensors)
}

/// Bits per element of a safetensors dtype.
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" => 64,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        _ => return None,
    })
}

/// Checks a rank's delivered synthetic product, as the fetch kept it in `dir`, against its
/// task (seed and size from the award) without recomputing it: `result.json` answers this
/// task, `product.i32` is `4 n^2` bytes, hashes to the result, and passes Freivalds' check
/// with a vector drawn from fresh randomness ([`SyntheticTask::verify`]).
///
/// [`SyntheticTask::verify`]: cannabis_protocol::synthetic::SyntheticTask::verify
pub fn check_product(dir: &Path, seed: Digest, n: u32) -> Result<(), String> {
    use cannabis_protocol::{SYNTHETIC_PRODUCT, SYNTHETIC_RESULT, synthetic::SyntheticTask};
    let mut text = String::new();
    File::open(dir.join(SYNTHETIC_RESULT))
        .and_then(|f| f.take(4096).read_to_string(&mut text))
        .map_err(|e| format!("reading {SYNTHETIC_RESULT}: {e}"))?;
    let result: cannabis_runtime::exec::SyntheticResult = serde_json::from_str(&text)
        .map_err(|e| format!("{SYNTHETIC_RESULT} is not a synthetic result: {e}"))?;
    if result.seed != seed || result.n != n {
        return Err(format!(
            "{SYNTHETIC_RESULT} answers another task (seed {}, n {}; the award's is seed {seed}, n {n})",
            result.seed, result.n
        ));
    }
    let path = dir.join(SYNTHETIC_PRODUCT);
    let expected = 4 * u64::from(n).pow(2);
    let size = fs::metadata(&path)
        .map_err(|e| format!("reading {SYNTHETIC_PRODUCT}: {e}"))?
        .len();
    if size != expected {
        return Err(format!(
            "{SYNTHETIC_PRODUCT} is {size} bytes; a {n}x{n} product is {expected}"
        ));
    }
    let bytes = fs::read(&path).map_err(|e| format!("reading {SYNTHETIC_PRODUCT}: {e}"))?;
    let c: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let task = SyntheticTask::new(seed, n).map_err(|e| e.to_string())?;
    let mut r_seed = [0u8; 32];
    getrandom::getrandom(&mut r_seed).map_err(|e| format!("the system random source: {e}"))?;
    task.verify(&c, &result.result_hash, &Digest(r_seed))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The leaf hashes of a file cut in transfer chunks, read back.
    fn leaves_of(path: &Path) -> io::Result<Vec<Digest>> {
        let mut f = File::open(path)?;
        let mut buf = vec![0u8; TRANSFER_CHUNK as usize];
        let mut leaves = Vec::new();
        loop {
            let n = read_full(&mut f, &mut buf)?;
            if n == 0 {
                break;
            }
            leaves.push(merkle::leaf_hash(&buf[..n]));
        }
        Ok(leaves)
    }

    #[test]
    fn the_leaves_hashed_while_writing_are_those_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let chunk = TRANSFER_CHUNK as usize;
        for size in [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 5] {
            let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            let path = dir.path().join(format!("f{size}"));
            let mut w = LeafWriter::new(File::create(&path).unwrap());
            // Uneven writes, some across a leaf's end.
            for piece in data.chunks(100_003) {
                w.write_all(piece).unwrap();
            }
            let (f, leaves) = w.finish();
            drop(f);
            assert_eq!(leaves, leaves_of(&path).unwrap(), "size {size}");
            assert_eq!(leaves.len(), size.div_ceil(chunk), "size {size}");
        }
    }

    #[test]
    fn a_sealed_file_decrypts_to_its_bytes_with_their_digest_and_leaves_and_a_cap_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let me = DeliveryIdentity::from_secret([4; 32]);
        let id = age::x25519::Identity::from_str(&me.to_age_string()).unwrap();
        // Sizes about the pipeline's buffers and the transfer's chunks, read in uneven
        // pieces as an executor hands them over.
        for size in [0, 1, STAGE_BYTES - 1, STAGE_BYTES, 3 * STAGE_BYTES + 12_345] {
            let data: Vec<u8> = (0..size).map(|i| (i * 7 % 253) as u8).collect();
            let path = dir.path().join(format!("s{size}.age"));
            let mut out = File::create(&path).unwrap();
            let (digest, n, leaves) = encrypt(
                |at| {
                    let at = at as usize;
                    let end = (at + 300_007).min(data.len());
                    Ok((data[at..end].to_vec(), end == data.len()))
                },
                &me.recipient(),
                &mut out,
                size as u64,
                "s",
            )
            .unwrap();
            assert_eq!((digest, n), (Digest::of(&data), size as u64), "size {size}");
            assert_eq!(leaves, leaves_of(&path).unwrap(), "size {size}");
            let mut plain = Vec::new();
            age::Decryptor::new(File::open(&path).unwrap())
                .unwrap()
                .decrypt(std::iter::once(&id as &dyn age::Identity))
                .unwrap()
                .read_to_end(&mut plain)
                .unwrap();
            assert!(plain == data, "size {size}");
            // One byte over the cap is an error, never a shorter file sealed.
            let over = encrypt(
                |at| {
                    let at = at as usize;
                    let end = (at + 300_007).min(data.len());
                    Ok((data[at..end].to_vec(), end == data.len()))
                },
                &me.recipient(),
                &mut File::create(&path).unwrap(),
                (size as u64).saturating_sub(1),
                "s",
            );
            if size > 0 {
                let e = over.unwrap_err();
                assert!(e.contains("over its max_size"), "{e}");
            }
        }
        // A reader that fails says so.
        let e = encrypt(
            |_| Err(io::Error::other("the disk went away")),
            &me.recipient(),
            &mut File::create(dir.path().join("x.age")).unwrap(),
            10,
            "x",
        )
        .unwrap_err();
        assert!(e.contains("the disk went away"), "{e}");
    }

    fn tensors(header: &str, data: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data));
        v
    }

    fn check(bytes: &[u8]) -> Result<(), String> {
        check_safetensors(&mut &bytes[..], bytes.len() as u64)
    }

    #[test]
    fn a_valid_safetensors_header_passes() {
        let h = r#"{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"U8","shape":[3],"data_offsets":[16,19]}}"#;
        check(&tensors(h, 19)).unwrap();
    }

    #[test]
    fn malformed_safetensors_headers_are_refused_each_for_its_reason() {
        let cases = [
            (tensors("{", 0), "not a JSON object"),
            (
                tensors(
                    r#"{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}"#,
                    1,
                ),
                "unknown dtype",
            ),
            (
                tensors(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                    4,
                ),
                "is not 4 bytes",
            ),
            (
                tensors(
                    r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
                    4,
                ),
                "outside",
            ),
            (
                tensors(
                    r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                    6,
                ),
                "overlaps",
            ),
            (
                tensors(
                    r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                    4,
                ),
                "belong to no tensor",
            ),
            (u64::MAX.to_le_bytes().to_vec(), "a header of"),
            (vec![1, 2], "shorter"),
        ];
        for (bytes, why) in cases {
            let e = check(&bytes).unwrap_err();
            assert!(e.contains(why), "{e} (wanted {why:?})");
        }
    }

    #[test]
    fn a_pickle_named_safetensors_is_refused_as_a_pickle() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        // `pickle.dumps({}, protocol=4)`.
        fs::write(&p, b"\x80\x04\x95\x04\x00\x00\x00\x00\x00\x00\x00}\x94.").unwrap();
        let e = check_content("model.safetensors", &p).unwrap_err();
        assert!(e.contains("pickle"), "{e}");
        fs::write(&p, b"PK\x03\x04....archive/data.pkl....").unwrap();
        assert!(
            check_content("model.pt", &p)
                .unwrap_err()
                .contains("pickle")
        );
        fs::write(&p, b"plain text.").unwrap();
        check_content("notes.txt", &p).unwrap();
    }

    /// The product a worker delivers passes; a wrong one, one for another task, a short
    /// one and a missing one are each refused with the reason.
    #[test]
    fn a_delivered_product_is_checked_without_recomputing_it() {
        use cannabis_protocol::{SYNTHETIC_PRODUCT, SYNTHETIC_RESULT};
        let dir = tempfile::tempdir().unwrap();
        let (seed, n) = (Digest::of(b"award"), 40);
        let write = |seed: Digest, tamper: bool| {
            let (result, mut bytes) = cannabis_runtime::exec::run_synthetic(seed, n).unwrap();
            if tamper {
                // One entry off by one, and the result hash made to match it.
                bytes[44] ^= 1;
                let c: Vec<i32> = bytes
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let forged = cannabis_runtime::exec::SyntheticResult {
                    result_hash: cannabis_protocol::synthetic::result_hash(&c),
                    ..result
                };
                fs::write(
                    dir.path().join(SYNTHETIC_RESULT),
                    serde_json::to_vec(&forged).unwrap(),
                )
                .unwrap();
            } else {
                fs::write(
                    dir.path().join(SYNTHETIC_RESULT),
                    serde_json::to_vec(&result).unwrap(),
                )
                .unwrap();
            }
            fs::write(dir.path().join(SYNTHETIC_PRODUCT), bytes).unwrap();
        };
        write(seed, false);
        assert_eq!(check_product(dir.path(), seed, n), Ok(()));
        write(seed, true);
        let e = check_product(dir.path(), seed, n).unwrap_err();
        assert!(e.contains("Freivalds"), "{e}");
        write(Digest::of(b"another award"), false);
        let e = check_product(dir.path(), seed, n).unwrap_err();
        assert!(e.contains("answers another task"), "{e}");
        write(seed, false);
        let short = fs::read(dir.path().join(SYNTHETIC_PRODUCT)).unwrap();
        fs::write(dir.path().join(SYNTHETIC_PRODUCT), &short[4..]).unwrap();
        let e = check_product(dir.path(), seed, n).unwrap_err();
        assert!(e.contains("6396 bytes; a 40x40 product is 6400"), "{e}");
        fs::remove_file(dir.path().join(SYNTHETIC_PRODUCT)).unwrap();
        let e = check_product(dir.path(), seed, n).unwrap_err();
        assert!(e.contains("reading product.i32"), "{e}");
    }
}
