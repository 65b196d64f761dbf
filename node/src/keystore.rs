//! The node's key files.
//!
//! - `keys/node.key`: the 32-byte ed25519 secret, raw.
//! - `keys/delivery.age`: the X25519 identity in age's own file format, so the `age` tool
//!   can decrypt what was sent to this node.
//!
//! Both are written with mode 0600 inside a 0700 directory, through a temporary file, fsync
//! and rename, so a crash never leaves a half-written key. Loading refuses a key that other
//! users can read, or that has the wrong length, with a message that says what to do.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use cannabis_protocol::{DeliveryIdentity, Keypair};
use zeroize::Zeroizing;

const NODE_KEY: &str = "node.key";
const DELIVERY_KEY: &str = "delivery.age";

/// The node's identities, loaded from its data directory.
pub struct NodeKeys {
    pub signing: Keypair,
    pub delivery: DeliveryIdentity,
}

/// Where the key files live.
pub struct KeyPaths {
    pub dir: PathBuf,
    pub node: PathBuf,
    pub delivery: PathBuf,
}

impl KeyPaths {
    pub fn new(data_dir: &Path) -> Self {
        let dir = data_dir.join("keys");
        Self {
            node: dir.join(NODE_KEY),
            delivery: dir.join(DELIVERY_KEY),
            dir,
        }
    }

    fn exists(&self) -> bool {
        self.node.exists() || self.delivery.exists()
    }
}

/// Fills `buf` from the operating system's random source.
pub fn random_bytes<const N: usize>() -> anyhow::Result<Zeroizing<[u8; N]>> {
    let mut buf = Zeroizing::new([0u8; N]);
    getrandom::getrandom(&mut buf[..]).context("reading the system random source")?;
    Ok(buf)
}

/// Creates fresh keys. Existing keys are kept unless `force`, and even then the old files
/// are renamed aside, never deleted.
pub fn create(paths: &KeyPaths, force: bool, now_unix: u64) -> anyhow::Result<NodeKeys> {
    if paths.exists() && !force {
        bail!(
            "keys already exist in {}; use `cannabis keys show` to see them, or \
             `cannabis keys new --force` to replace them (the old files are kept)",
            paths.dir.display()
        );
    }
    fs::create_dir_all(&paths.dir).with_context(|| format!("creating {}", paths.dir.display()))?;
    fs::set_permissions(&paths.dir, fs::Permissions::from_mode(0o700))
        .with_context(|| format!("setting permissions on {}", paths.dir.display()))?;

    let signing = Keypair::from_secret(*random_bytes::<32>()?);
    let delivery = DeliveryIdentity::from_secret(*random_bytes::<32>()?);
    let delivery_file = Zeroizing::new(format!(
        "# cannabis node delivery identity (age format)\n# public key: {}\n{}\n",
        delivery.recipient(),
        delivery.to_age_string().as_str()
    ));

    for path in [&paths.node, &paths.delivery] {
        if path.exists() {
            let aside = path.with_extension(format!(
                "{}.replaced-{now_unix}",
                path.extension().and_then(|e| e.to_str()).unwrap_or("key")
            ));
            fs::rename(path, &aside).with_context(|| {
                format!("moving {} aside to {}", path.display(), aside.display())
            })?;
        }
    }
    write_private(&paths.node, &signing.secret()[..])?;
    write_private(&paths.delivery, delivery_file.as_bytes())?;
    Ok(NodeKeys { signing, delivery })
}

/// Loads the keys, checking permissions and lengths.
pub fn load(paths: &KeyPaths) -> anyhow::Result<NodeKeys> {
    let node = read_private(&paths.node)?;
    let signing = Keypair::from_secret_slice(&node)
        .with_context(|| format!("loading {}", paths.node.display()))?;
    let text = read_private(&paths.delivery)?;
    let text = std::str::from_utf8(&text)
        .with_context(|| format!("{} is not text", paths.delivery.display()))?;
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .with_context(|| format!("{} holds no key", paths.delivery.display()))?;
    let delivery = DeliveryIdentity::from_age_string(line)
        .with_context(|| format!("loading {}", paths.delivery.display()))?;
    Ok(NodeKeys { signing, delivery })
}

pub fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    if let Some(dir) = path.parent() {
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("syncing {}", dir.display()))?;
    }
    Ok(())
}

pub fn read_private(path: &Path) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "no key at {}; create one with `cannabis keys new` (or pass --data-dir)",
            path.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        bail!(
            "{} has permissions {mode:04o}, so other users can read it; a key must be \
             readable by its owner only: run `chmod 600 {}`",
            path.display(),
            path.display()
        );
    }
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Zeroizing::new(bytes))
}
