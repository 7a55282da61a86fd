//! Patch formats: JSON merge patch (RFC 7386), JSON patch (RFC 6902), and the two
//! Kubernetes-specific ones reduced to merge patch.
//!
//! Strategic merge patch merges lists of known types by key (containers by name, ...);
//! here lists are replaced whole and `$patch`-style directives are dropped. Server-side
//! apply tracks field ownership; here it is a merge patch that may create the object.
//! Both reductions give the same result for the patches wasmplane and kube's helpers send
//! (whole-spec applies of Leases, status objects).

use serde_json::{Map, Value};

use crate::error::ApiError;

/// The patch flavours, from the request's `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// `application/merge-patch+json`
    Merge,
    /// `application/strategic-merge-patch+json`
    Strategic,
    /// `application/json-patch+json`
    Json,
    /// `application/apply-patch+yaml` (server-side apply)
    Apply,
}

impl PatchKind {
    pub fn from_content_type(content_type: &str) -> Result<Self, ApiError> {
        let mime = content_type.split(';').next().unwrap_or_default().trim();
        match mime {
            "application/merge-patch+json" => Ok(Self::Merge),
            "application/strategic-merge-patch+json" => Ok(Self::Strategic),
            "application/json-patch+json" => Ok(Self::Json),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Ok(Self::Apply),
            other => Err(ApiError::UnsupportedMediaType(format!(
                "the body of the request was in an unknown format - accepted media types include: \
                 application/json-patch+json, application/merge-patch+json, \
                 application/apply-patch+yaml (got {other:?})"
            ))),
        }
    }

    /// Parse a patch body. Apply bodies may be YAML; kube sends JSON, which is YAML too.
    pub fn parse_body(self, body: &[u8]) -> Result<Value, ApiError> {
        let parsed = serde_json::from_slice::<Value>(body);
        match (self, parsed) {
            (_, Ok(value)) => Ok(value),
            (Self::Apply, Err(_)) => serde_yaml::from_slice::<Value>(body)
                .map_err(|e| ApiError::BadRequest(format!("error decoding YAML apply patch: {e}"))),
            (_, Err(e)) => Err(ApiError::BadRequest(format!("error decoding patch: {e}"))),
        }
    }

    /// Apply the patch to `target` in place. The result must still be an object: a patch
    /// body like `[1]` as a merge patch would replace the whole object with an array.
    pub fn apply_to(self, target: &mut Value, patch: &Value) -> Result<(), ApiError> {
        let mut patched = target.clone();
        match self {
            Self::Merge | Self::Apply => merge_patch(&mut patched, patch),
            Self::Strategic => merge_patch(&mut patched, &strip_directives(patch)),
            Self::Json => json_patch(&mut patched, patch)?,
        }
        if !patched.is_object() {
            return Err(ApiError::BadRequest("the patch does not leave an object".into()));
        }
        *target = patched;
        Ok(())
    }
}

/// RFC 7386: objects merge recursively, `null` deletes, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target) = target else {
        return;
    };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Drop strategic-merge directives (`$patch`, `$setElementOrder/...`, `$retainKeys`, ...)
/// so they do not end up stored as fields.
fn strip_directives(patch: &Value) -> Value {
    match patch {
        Value::Object(map) => Value::Object(
            map.iter().filter(|(k, _)| !k.starts_with('$')).map(|(k, v)| (k.clone(), strip_directives(v))).collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(strip_directives).collect()),
        other => other.clone(),
    }
}

fn invalid(message: String) -> ApiError {
    ApiError::Invalid(message)
}

/// RFC 6901 pointer → unescaped tokens.
fn pointer_tokens(pointer: &str) -> Result<Vec<String>, ApiError> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(invalid(format!("json patch: invalid pointer {pointer:?}")));
    };
    Ok(rest.split('/').map(|t| t.replace("~1", "/").replace("~0", "~")).collect())
}

/// The container holding the pointer's last token, and that token.
fn parent_mut<'a>(doc: &'a mut Value, pointer: &str) -> Result<(&'a mut Value, String), ApiError> {
    let mut tokens = pointer_tokens(pointer)?;
    let last = tokens.pop().ok_or_else(|| invalid("json patch: cannot operate on the whole document".into()))?;
    let mut cursor = doc;
    for token in tokens {
        cursor = match cursor {
            Value::Object(map) => map.get_mut(&token),
            Value::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
            _ => None,
        }
        .ok_or_else(|| invalid(format!("json patch: path {pointer:?} does not exist")))?;
    }
    Ok((cursor, last))
}

fn patch_add(doc: &mut Value, pointer: &str, value: Value) -> Result<(), ApiError> {
    let (parent, last) = parent_mut(doc, pointer)?;
    match parent {
        Value::Object(map) => {
            map.insert(last, value);
            Ok(())
        }
        Value::Array(items) => {
            let index = if last == "-" { items.len() } else { last.parse::<usize>().unwrap_or(usize::MAX) };
            if index > items.len() {
                return Err(invalid(format!("json patch: index out of range in {pointer:?}")));
            }
            items.insert(index, value);
            Ok(())
        }
        _ => Err(invalid(format!("json patch: parent of {pointer:?} is not a container"))),
    }
}

fn patch_remove(doc: &mut Value, pointer: &str) -> Result<Value, ApiError> {
    let (parent, last) = parent_mut(doc, pointer)?;
    let removed = match parent {
        Value::Object(map) => map.remove(&last),
        Value::Array(items) => match last.parse::<usize>() {
            Ok(i) if i < items.len() => Some(items.remove(i)),
            _ => None,
        },
        _ => None,
    };
    removed.ok_or_else(|| invalid(format!("json patch: path {pointer:?} does not exist")))
}

/// RFC 6902 operations: add, remove, replace, move, copy, test. All or nothing.
pub fn json_patch(target: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let operations =
        patch.as_array().ok_or_else(|| ApiError::BadRequest("json patch must be an array of operations".into()))?;
    let mut doc = target.clone();
    for op in operations {
        let field = |name: &str| op.get(name).and_then(Value::as_str);
        let path = field("path").ok_or_else(|| invalid("json patch: operation without path".into()))?;
        let value = || op.get("value").cloned().ok_or_else(|| invalid("json patch: operation without value".into()));
        match field("op").unwrap_or_default() {
            "add" => patch_add(&mut doc, path, value()?)?,
            "remove" => {
                patch_remove(&mut doc, path)?;
            }
            "replace" => {
                patch_remove(&mut doc, path)?;
                patch_add(&mut doc, path, value()?)?;
            }
            "move" => {
                let from = field("from").ok_or_else(|| invalid("json patch: move without from".into()))?;
                let moved = patch_remove(&mut doc, from)?;
                patch_add(&mut doc, path, moved)?;
            }
            "copy" => {
                let from = field("from").ok_or_else(|| invalid("json patch: copy without from".into()))?;
                let copied = doc
                    .pointer(from)
                    .cloned()
                    .ok_or_else(|| invalid(format!("json patch: path {from:?} does not exist")))?;
                patch_add(&mut doc, path, copied)?;
            }
            "test" => {
                // As the API server's JSON patch library: a missing member tests equal to
                // null (kube's finalizer helper relies on it to add the first finalizer).
                if doc.pointer(path).unwrap_or(&Value::Null) != &value()? {
                    return Err(invalid(format!("json patch: test operation failed at {path:?}")));
                }
            }
            other => return Err(invalid(format!("json patch: unknown operation {other:?}"))),
        }
    }
    *target = doc;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(&mut doc, &json!({"a": "z", "c": {"f": null}, "l": [3]}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));
    }

    #[test]
    fn a_patch_cannot_replace_the_object() {
        let mut doc = json!({"a": 1});
        assert!(PatchKind::Merge.apply_to(&mut doc, &json!([1])).is_err());
        assert_eq!(doc, json!({"a": 1}));
    }

    #[test]
    fn strategic_drops_directives() {
        let mut doc = json!({"spec": {"x": 1}});
        PatchKind::Strategic
            .apply_to(&mut doc, &json!({"spec": {"y": 2, "$retainKeys": ["y"]}, "$patch": "merge"}))
            .unwrap();
        assert_eq!(doc, json!({"spec": {"x": 1, "y": 2}}));
    }

    #[test]
    fn json_patch_ops() {
        let mut doc = json!({"metadata": {"labels": {"a": "1"}}, "list": [1, 2]});
        json_patch(
            &mut doc,
            &json!([
                {"op": "test", "path": "/metadata/labels/a", "value": "1"},
                {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
                {"op": "replace", "path": "/list/0", "value": 9},
                {"op": "add", "path": "/list/-", "value": 3},
                {"op": "copy", "from": "/list/0", "path": "/copied"},
                {"op": "move", "from": "/metadata/labels/a", "path": "/moved"},
                {"op": "remove", "path": "/list/1"},
            ]),
        )
        .unwrap();
        assert_eq!(doc, json!({"metadata": {"labels": {"b/c": "2"}}, "list": [9, 3], "copied": 9, "moved": "1"}));
        let before = doc.clone();
        let failed = json_patch(
            &mut doc,
            &json!([{"op": "remove", "path": "/copied"}, {"op": "test", "path": "/moved", "value": "x"}]),
        );
        assert!(matches!(failed, Err(ApiError::Invalid(_))));
        assert_eq!(doc, before, "a failed patch changes nothing");

        // A missing member is null to `test`, and only null.
        json_patch(&mut doc, &json!([{"op": "test", "path": "/metadata/finalizers", "value": null}, {"op": "add", "path": "/metadata/finalizers", "value": ["f"]}])).unwrap();
        assert_eq!(doc["metadata"]["finalizers"], json!(["f"]));
        let missing = json_patch(&mut doc, &json!([{"op": "test", "path": "/metadata/absent", "value": []}]));
        assert!(matches!(missing, Err(ApiError::Invalid(_))));
    }
}
