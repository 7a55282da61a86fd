//! Validation of `deploy/` lives in `tests/manifests.rs`: it renders the kustomization,
//! parses every object strictly as its typed Kubernetes kind, and checks the security
//! properties (capabilities, RBAC, probes, resource limits, flags `wasmplane run` accepts).
