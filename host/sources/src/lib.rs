//! Where cluster state comes from: Kubernetes objects, read as the parts wasmplane uses
//! ([`slim`]) and converted to model types ([`convert`]), and manifest directories for
//! embedded mode ([`manifests`]).

pub mod convert;
pub mod kube;
pub mod manifests;
pub mod slim;
