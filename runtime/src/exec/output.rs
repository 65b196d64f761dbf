//! Output reads: bounded chunks at resumable offsets, from standard output, standard error
//! or a declared output name, and nothing else.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::attempt::Attempt;
use crate::sandbox::files;

/// Largest chunk one read returns.
pub const MAX_CHUNK: u64 = 1 << 20;

/// One chunk of an output.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Chunk {
    /// Where the chunk starts.
    pub offset: u64,
    /// Its bytes.
    #[serde(with = "serde_bytes_hex")]
    pub data: Vec<u8>,
    /// Where the next read starts.
    pub next_offset: u64,
    /// Size of the output now.
    pub size: u64,
    /// Whether this is the end and the output will not grow.
    pub eof: bool,
}

mod serde_bytes_hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(data: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&data.iter().map(|b| format!("{b:02x}")).collect::<String>())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        if text.len() % 2 != 0 {
            return Err(serde::de::Error::custom("odd hex length"));
        }
        (0..text.len())
            .step_by(2)
            .map(|i| {
                u8::from_str_radix(text.get(i..i + 2).unwrap_or("zz"), 16)
                    .map_err(serde::de::Error::custom)
            })
            .collect()
    }
}

/// Why an output cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OutputError {
    /// Not stdout, stderr or a declared output.
    #[error(
        "{0:?} is not an output of this attempt: read stdout, stderr or a declared output name"
    )]
    Undeclared(String),
    /// Declared but not there (not written, refused, or not finished yet).
    #[error("output {0:?} is not available: {1}")]
    Missing(String, String),
    /// Reading failed.
    #[error("reading output {0:?}: {1}")]
    Io(String, String),
}

/// Reads at most `max` bytes (capped at [`MAX_CHUNK`]) of output `name` from `offset`.
pub(crate) fn read(
    dir: &Path,
    attempt: &Attempt,
    declared: &[String],
    name: &str,
    offset: u64,
    max: u64,
) -> Result<Chunk, OutputError> {
    // A checkpoint's copy is whole once it has its name: it ends where the file does.
    let mut whole = false;
    let checkpoint = attempt.request.task.checkpoint.is_some();
    let rel = match name {
        "stdout" => files::STDOUT.to_string(),
        "stderr" => files::STDERR.to_string(),
        "checkpoint/latest" if checkpoint => {
            whole = true;
            format!("{}/latest.json", files::CHECKPOINTS)
        }
        _ if checkpoint
            && name.strip_prefix("checkpoint/").is_some_and(|n| {
                !n.is_empty() && n.len() <= 20 && n.bytes().all(|b| b.is_ascii_digit())
            }) =>
        {
            whole = true;
            format!(
                "{}/{}.age",
                files::CHECKPOINTS,
                &name["checkpoint/".len()..]
            )
        }
        _ if declared.iter().any(|d| d == name) => format!("{}/{name}", files::OUTPUTS),
        _ => return Err(OutputError::Undeclared(name.to_string())),
    };
    let io = |e: std::io::Error| OutputError::Io(name.to_string(), e.to_string());
    // No symbolic link anywhere beneath the attempt directory is followed.
    let file = super::open_beneath(dir, &rel);
    let mut file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let why = if attempt.state.is_final() {
                "it was not produced"
            } else {
                "the attempt has not finished"
            };
            return Err(OutputError::Missing(name.to_string(), why.into()));
        }
        Err(e) => return Err(io(e)),
    };
    let meta = file.metadata().map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(OutputError::Io(name.into(), "not a regular file".into()));
    }
    let size = meta.len();
    let start = offset.min(size);
    file.seek(SeekFrom::Start(start)).map_err(io)?;
    let mut data = Vec::new();
    file.take(max.min(MAX_CHUNK))
        .read_to_end(&mut data)
        .map_err(io)?;
    let next_offset = start + data.len() as u64;
    Ok(Chunk {
        offset: start,
        data,
        next_offset,
        size,
        eof: next_offset >= size && (whole || attempt.state.is_final()),
    })
}
