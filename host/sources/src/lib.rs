//! Where cluster state comes from: Kubernetes objects converted to model types
//! ([`convert`]) and manifest directories for embedded mode ([`manifests`]).

pub mod convert;
pub mod kube;
pub mod manifests;
