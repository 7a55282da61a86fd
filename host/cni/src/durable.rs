//! A JSON state file in the daemon's state directory, replaced atomically (write, fsync,
//! rename) on every change, with group commit: what the allocator and the chained
//! attachments persist through, so a restart recovers exactly what callers were told.

use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::Error;

pub(crate) struct DurableFile {
    path: PathBuf,
    /// The last state version known to be on disk; its lock is held while writing.
    durable: Mutex<u64>,
}

impl DurableFile {
    /// Opens `name` in `dir` (creating the directory) and reads it: `T::default()` when there
    /// is no such file yet, an error when it is unreadable (never a silent reset).
    pub(crate) fn open<T: DeserializeOwned + Default>(dir: &Path, name: &str) -> Result<(DurableFile, T), Error> {
        fs::create_dir_all(dir).map_err(|source| Error::State { path: dir.into(), source })?;
        let path = dir.join(name);
        let contents = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| Error::CorruptState { path: path.clone(), reason: e.to_string() })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => T::default(),
            Err(source) => return Err(Error::State { path, source }),
        };
        Ok((DurableFile { path, durable: Mutex::new(0) }, contents))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Group commit: makes every change up to `version` durable. `snapshot` gives the whole
    /// state and the version it is at. One writer at a time; a caller that waited while
    /// another wrote usually finds its change already on disk, so a burst of N changes
    /// costs a few fsyncs, not N.
    pub(crate) fn flush_to<T: Serialize>(
        &self,
        version: u64,
        snapshot: impl FnOnce() -> (T, u64),
    ) -> Result<(), Error> {
        let mut durable = self.durable.lock().unwrap_or_else(|p| p.into_inner());
        if *durable >= version {
            return Ok(());
        }
        let (contents, at) = snapshot();
        self.write(&contents)?;
        *durable = at;
        Ok(())
    }

    fn write<T: Serialize>(&self, contents: &T) -> Result<(), Error> {
        let bytes = serde_json::to_vec_pretty(contents)
            .map_err(|e| Error::Internal(format!("serialising {}: {e}", self.path.display())))?;
        let mut tmp = self.path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let err = |source| Error::State { path: self.path.clone(), source };
        let mut f = File::create(&tmp).map_err(err)?;
        f.write_all(&bytes).map_err(err)?;
        // Content on disk before the rename: after a crash the file is the old state or the
        // new one, never empty or torn.
        f.sync_all().map_err(err)?;
        fs::rename(&tmp, &self.path).map_err(err)?;
        // The directory is not synced: a rename lost to a power cut leaves the previous
        // state, and every pod it lacks died with the machine anyway. A daemon restart
        // (the case that matters) sees the rename at once. Saves a journal commit per ADD.
        Ok(())
    }
}
