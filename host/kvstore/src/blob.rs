//! Content-addressed, chunked blobs (how the host stores Wasm modules).
//!
//! etcd refuses requests above ~1.5 MiB, and modules can be bigger, so a blob is
//! split into chunks of at most [`CHUNK_SIZE`] bytes:
//!
//! ```text
//! <prefix>/<sha256>          manifest (JSON: size, chunk size, chunk count)
//! <prefix>/<sha256>/<i>      chunk i, zero-padded so keys sort numerically
//! ```
//!
//! Chunks are written first and the manifest last (create-if-absent), so a
//! visible manifest means a complete blob; a watcher of `<prefix>/` learns of a
//! new blob from its manifest key (the one without a further `/`). The name is
//! the SHA-256 of the content: uploading the same bytes twice is a no-op, and
//! [`get_blob`] verifies what it reassembles.

use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::debug;

use crate::{Bytes, KvError, KvStore, Result};

/// Largest chunk value, well below etcd's request limit.
pub const CHUNK_SIZE: usize = 512 * 1024;

/// Chunk writes in flight at once.
const PARALLEL_CHUNKS: usize = 4;

/// What the manifest key holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobManifest {
    /// Hex SHA-256 of the whole content.
    pub digest: String,
    pub size: u64,
    pub chunk_size: u64,
    pub chunks: u32,
}

fn base(prefix: &str) -> &str {
    prefix.trim_end_matches('/')
}

/// Key of a blob's manifest.
pub fn manifest_key(prefix: &str, digest: &str) -> String {
    format!("{}/{digest}", base(prefix))
}

/// Key of one chunk.
pub fn chunk_key(prefix: &str, digest: &str, index: u32) -> String {
    format!("{}/{digest}/{index:08}", base(prefix))
}

/// Whether `key` (under `prefix`) is a manifest, and of which digest. Lets a
/// watcher of the prefix ignore chunk keys.
pub fn manifest_digest<'a>(prefix: &str, key: &'a str) -> Option<&'a str> {
    let rest = key.strip_prefix(base(prefix))?.strip_prefix('/')?;
    (is_digest(rest)).then_some(rest)
}

fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Hex SHA-256 of `data`: the name [`put_blob`] stores it under.
pub fn digest_of(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Stores `data` under `prefix` and returns its digest. Idempotent.
pub async fn put_blob(store: &dyn KvStore, prefix: &str, data: &[u8]) -> Result<String> {
    let digest = digest_of(data);
    let manifest_key = manifest_key(prefix, &digest);
    if store.get(&manifest_key).await?.is_some() {
        debug!(digest, "blob already stored");
        return Ok(digest);
    }
    let chunks: Vec<&[u8]> = data.chunks(CHUNK_SIZE).collect();
    let count = u32::try_from(chunks.len())
        .map_err(|_| KvError::TooLarge { size: data.len(), limit: CHUNK_SIZE * u32::MAX as usize })?;
    // Owned keys and values before the stream: a closure taking borrowed chunks makes the
    // future not `Send` for every lifetime (rustc #64552), which axum handlers need.
    let writes: Vec<(String, Bytes)> = chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| (chunk_key(prefix, &digest, i as u32), Bytes::copy_from_slice(chunk)))
        .collect();
    futures::stream::iter(writes)
        .map(|(key, value)| async move { store.put(&key, value, None).await })
        .buffer_unordered(PARALLEL_CHUNKS)
        .try_collect::<Vec<_>>()
        .await?;
    let manifest =
        BlobManifest { digest: digest.clone(), size: data.len() as u64, chunk_size: CHUNK_SIZE as u64, chunks: count };
    let encoded =
        serde_json::to_vec(&manifest).map_err(|e| KvError::Backend(format!("encoding blob manifest: {e}")))?;
    // Concurrent uploads of the same content race harmlessly: same chunks, and
    // whoever loses the create finds an identical manifest.
    store.create(&manifest_key, Bytes::from(encoded), None).await?;
    debug!(digest, size = data.len(), chunks = count, "blob stored");
    Ok(digest)
}

/// Reads a blob's manifest.
pub async fn get_blob_manifest(store: &dyn KvStore, prefix: &str, digest: &str) -> Result<BlobManifest> {
    let key = manifest_key(prefix, digest);
    let kv = store.get(&key).await?.ok_or_else(|| KvError::NotFound(key.clone()))?;
    let manifest: BlobManifest = serde_json::from_slice(&kv.value)
        .map_err(|e| KvError::Corrupt { key: key.clone(), reason: format!("manifest is not valid JSON: {e}") })?;
    if manifest.digest != digest {
        return Err(KvError::Corrupt { key, reason: format!("manifest names digest {}", manifest.digest) });
    }
    Ok(manifest)
}

/// Reassembles a blob and verifies size and digest.
pub async fn get_blob(store: &dyn KvStore, prefix: &str, digest: &str) -> Result<Bytes> {
    let manifest = get_blob_manifest(store, prefix, digest).await?;
    let chunk_prefix = format!("{}/", manifest_key(prefix, digest));
    let listing = store.list_prefix(&chunk_prefix).await?;
    let corrupt = |reason: String| KvError::Corrupt { key: manifest_key(prefix, digest), reason };
    if listing.items.len() != manifest.chunks as usize {
        return Err(corrupt(format!("{} chunks stored, manifest says {}", listing.items.len(), manifest.chunks)));
    }
    let mut data = Vec::with_capacity(manifest.size as usize);
    for (i, kv) in listing.items.iter().enumerate() {
        if kv.key != chunk_key(prefix, digest, i as u32) {
            return Err(corrupt(format!("unexpected chunk key {:?}", kv.key)));
        }
        data.extend_from_slice(&kv.value);
    }
    if data.len() as u64 != manifest.size {
        return Err(corrupt(format!("{} bytes stored, manifest says {}", data.len(), manifest.size)));
    }
    let actual = digest_of(&data);
    if actual != digest {
        return Err(corrupt(format!("content hashes to {actual}")));
    }
    Ok(Bytes::from(data))
}

/// Deletes a blob: the manifest first (so nobody starts reading it), then the chunks.
pub async fn delete_blob(store: &dyn KvStore, prefix: &str, digest: &str) -> Result<()> {
    store.delete(&manifest_key(prefix, digest)).await?;
    store.delete_prefix(&format!("{}/", manifest_key(prefix, digest))).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_manifest_detection() {
        let digest = digest_of(b"x");
        assert_eq!(manifest_key("mods/", &digest), format!("mods/{digest}"));
        assert_eq!(chunk_key("mods", &digest, 3), format!("mods/{digest}/00000003"));
        assert_eq!(manifest_digest("mods/", &manifest_key("mods", &digest)), Some(digest.as_str()));
        assert_eq!(manifest_digest("mods/", &chunk_key("mods", &digest, 0)), None);
    }
}
