//! Validation of `deploy/` lives in `tests/manifests.rs`: it renders the kustomization,
//! parses every object strictly as its typed Kubernetes kind, and checks the security
//! properties (capabilities, RBAC, probes, resource limits, flags `wasmplane run` accepts).
//! The tree's formatting is checked in `tests/tidy.rs`.

use std::path::{Path, PathBuf};

/// The workspace's root, two levels above this crate.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/deploy is two levels below the workspace")
        .to_path_buf()
}

/// `deploy/`, what the manifest tests read.
pub fn deploy_dir() -> PathBuf {
    workspace().join("deploy")
}
