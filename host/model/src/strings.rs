//! The model's strings are [`CompactString`]s: names, addresses, label keys and values are
//! short (4.5 bytes on average at 10k services), a `String` costs a 32-byte heap chunk for
//! each, and up to 24 bytes live inline in a `CompactString` (BENCHMARKS.md, twelfth run).
//! Generated bindings (WIT, protobuf) and Kubernetes' types use `String`: these traits
//! convert at those edges.

use crate::CompactString;

/// A model string, or a list or option of them, as `std` owned strings.
pub trait ToStd {
    type Std;
    fn to_std(&self) -> Self::Std;
}

impl ToStd for CompactString {
    type Std = String;
    fn to_std(&self) -> String {
        self.as_str().to_owned()
    }
}

impl ToStd for [CompactString] {
    type Std = Vec<String>;
    fn to_std(&self) -> Vec<String> {
        self.iter().map(ToStd::to_std).collect()
    }
}

impl ToStd for Option<CompactString> {
    type Std = Option<String>;
    fn to_std(&self) -> Option<String> {
        self.as_deref().map(str::to_owned)
    }
}

/// `std` owned strings, or a list or option of them, as model strings.
pub trait IntoModel {
    type Model;
    fn into_model(self) -> Self::Model;
}

impl IntoModel for String {
    type Model = CompactString;
    fn into_model(self) -> CompactString {
        self.into()
    }
}

impl IntoModel for Vec<String> {
    type Model = Vec<CompactString>;
    fn into_model(self) -> Vec<CompactString> {
        self.into_iter().map(CompactString::from).collect()
    }
}

impl IntoModel for Option<String> {
    type Model = Option<CompactString>;
    fn into_model(self) -> Option<CompactString> {
        self.map(CompactString::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_keeps_short_strings_inline() {
        let names = vec!["10.244.1.5".to_string(), "a-name-longer-than-twenty-four-bytes".to_string()];
        let model = names.clone().into_model();
        assert!(!model[0].is_heap_allocated(), "short strings are inline");
        assert!(model[1].is_heap_allocated());
        assert_eq!(model.to_std(), names);
        assert_eq!(Some("x".to_string()).into_model().to_std(), Some("x".to_string()));
        assert_eq!(None::<String>.into_model(), None);
    }
}
