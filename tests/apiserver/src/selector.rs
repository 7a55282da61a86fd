//! Label and field selectors, parsed and matched as the API server does.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::error::ApiError;

/// One label requirement; a selector is their conjunction.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelRequirement {
    Exists(String),
    DoesNotExist(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    GreaterThan(String, i64),
    LessThan(String, i64),
}

/// A parsed `labelSelector` query parameter. The empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<LabelRequirement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Word(String),
    Comma,
    Open,
    Close,
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
}

fn tokenize(input: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut chars = input.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            ',' => {
                chars.next();
                tokens.push(Token::Comma);
            }
            '(' => {
                chars.next();
                tokens.push(Token::Open);
            }
            ')' => {
                chars.next();
                tokens.push(Token::Close);
            }
            '>' => {
                chars.next();
                tokens.push(Token::Gt);
            }
            '<' => {
                chars.next();
                tokens.push(Token::Lt);
            }
            '=' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    tokens.push(Token::DoubleEq);
                } else {
                    tokens.push(Token::Eq);
                }
            }
            '!' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    tokens.push(Token::NotEq);
                } else {
                    tokens.push(Token::Not);
                }
            }
            _ => {
                let mut word = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_whitespace() || ",()=!<>".contains(c) {
                        break;
                    }
                    word.push(c);
                    chars.next();
                }
                tokens.push(Token::Word(word));
            }
        }
    }
    tokens
}

fn bad_selector(input: &str, why: &str) -> ApiError {
    ApiError::BadRequest(format!("unable to parse requirement: invalid label selector {input:?}: {why}"))
}

impl LabelSelector {
    /// Parse the Kubernetes selector syntax: `a=b`, `a==b`, `a!=b`, `a in (x,y)`,
    /// `a notin (x)`, `a`, `!a`, `a>1`, `a<1`, joined by commas (AND).
    pub fn parse(input: &str) -> Result<Self, ApiError> {
        let tokens = tokenize(input);
        let mut requirements = Vec::new();
        let mut pos = 0;
        let word = |pos: usize| match tokens.get(pos) {
            Some(Token::Word(w)) => Some(w.clone()),
            _ => None,
        };
        while pos < tokens.len() {
            let requirement = if tokens[pos] == Token::Not {
                let key = word(pos + 1).ok_or_else(|| bad_selector(input, "expected a key after '!'"))?;
                pos += 2;
                LabelRequirement::DoesNotExist(key)
            } else {
                let key = word(pos).ok_or_else(|| bad_selector(input, "expected a key"))?;
                pos += 1;
                match tokens.get(pos) {
                    None | Some(Token::Comma) => LabelRequirement::Exists(key),
                    Some(op @ (Token::Eq | Token::DoubleEq | Token::NotEq)) => {
                        let negate = *op == Token::NotEq;
                        pos += 1;
                        // `key=` is a valid requirement on the empty value.
                        let value = word(pos).unwrap_or_default();
                        if word(pos).is_some() {
                            pos += 1;
                        }
                        if negate {
                            LabelRequirement::NotEquals(key, value)
                        } else {
                            LabelRequirement::Equals(key, value)
                        }
                    }
                    Some(op @ (Token::Gt | Token::Lt)) => {
                        let greater = *op == Token::Gt;
                        let value = word(pos + 1)
                            .and_then(|v| v.parse::<i64>().ok())
                            .ok_or_else(|| bad_selector(input, "expected an integer after '>' or '<'"))?;
                        pos += 2;
                        if greater {
                            LabelRequirement::GreaterThan(key, value)
                        } else {
                            LabelRequirement::LessThan(key, value)
                        }
                    }
                    Some(Token::Word(op)) if op == "in" || op == "notin" => {
                        let notin = op == "notin";
                        pos += 1;
                        if tokens.get(pos) != Some(&Token::Open) {
                            return Err(bad_selector(input, "expected '(' after in/notin"));
                        }
                        pos += 1;
                        let mut values = BTreeSet::new();
                        loop {
                            match tokens.get(pos) {
                                Some(Token::Word(v)) => {
                                    values.insert(v.clone());
                                    pos += 1;
                                }
                                Some(Token::Comma) => pos += 1,
                                Some(Token::Close) => {
                                    pos += 1;
                                    break;
                                }
                                _ => return Err(bad_selector(input, "unterminated value set")),
                            }
                        }
                        if notin { LabelRequirement::NotIn(key, values) } else { LabelRequirement::In(key, values) }
                    }
                    Some(_) => return Err(bad_selector(input, "unexpected operator")),
                }
            };
            requirements.push(requirement);
            match tokens.get(pos) {
                None => {}
                Some(Token::Comma) => {
                    pos += 1;
                    if pos == tokens.len() {
                        return Err(bad_selector(input, "trailing comma"));
                    }
                }
                Some(_) => return Err(bad_selector(input, "expected ',' between requirements")),
            }
        }
        Ok(Self { requirements })
    }

    /// Does an object (its `metadata.labels`) satisfy every requirement?
    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        let label = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        self.requirements.iter().all(|requirement| match requirement {
            LabelRequirement::Exists(k) => label(k).is_some(),
            LabelRequirement::DoesNotExist(k) => label(k).is_none(),
            LabelRequirement::Equals(k, v) => label(k) == Some(v.as_str()),
            // As in Kubernetes, `!=` and `notin` also match objects without the label.
            LabelRequirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => label(k).is_some_and(|l| vs.contains(l)),
            LabelRequirement::NotIn(k, vs) => !label(k).is_some_and(|l| vs.contains(l)),
            LabelRequirement::GreaterThan(k, n) => label(k).and_then(|l| l.parse::<i64>().ok()).is_some_and(|l| l > *n),
            LabelRequirement::LessThan(k, n) => label(k).and_then(|l| l.parse::<i64>().ok()).is_some_and(|l| l < *n),
        })
    }
}

/// One field requirement: a dotted path into the object, compared as a string.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldRequirement {
    path: Vec<String>,
    value: String,
    negate: bool,
}

/// A parsed `fieldSelector` query parameter. The empty selector matches everything.
///
/// A real server accepts only a few fields per kind (`metadata.name`, `metadata.namespace`,
/// `spec.nodeName`, `status.phase`, ...); this one accepts any dotted path, missing fields
/// comparing as the empty string (so `spec.nodeName=` selects unscheduled pods, as on a
/// real server).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    requirements: Vec<FieldRequirement>,
}

/// Split on an unescaped separator; `\` escapes the next character, as in Kubernetes.
fn split_unescaped(input: &str, separator: char) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = input.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let last = parts.last_mut().expect("parts is never empty");
                last.push('\\');
                if let Some(next) = chars.next() {
                    last.push(next);
                }
            }
            c if c == separator => parts.push(String::new()),
            c => parts.last_mut().expect("parts is never empty").push(c),
        }
    }
    parts
}

fn unescape(input: &str) -> String {
    let mut out = String::new();
    let mut chars = input.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(next) = chars.next() {
                out.push(next);
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl FieldSelector {
    /// Parse `path=value`, `path==value`, `path!=value` terms joined by commas.
    pub fn parse(input: &str) -> Result<Self, ApiError> {
        let mut requirements = Vec::new();
        for term in split_unescaped(input, ',') {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            // Find the first unescaped operator.
            let bytes = term.as_bytes();
            let mut i = 0;
            let mut found = None;
            while i < bytes.len() {
                match bytes[i] {
                    b'\\' => i += 2,
                    b'!' if bytes.get(i + 1) == Some(&b'=') => {
                        found = Some((i, 2, true));
                        break;
                    }
                    b'=' => {
                        let len = if bytes.get(i + 1) == Some(&b'=') { 2 } else { 1 };
                        found = Some((i, len, false));
                        break;
                    }
                    _ => i += 1,
                }
            }
            let (at, len, negate) = found.ok_or_else(|| {
                ApiError::BadRequest(format!("invalid field selector: {term:?}: expected an operator"))
            })?;
            let field = term[..at].trim();
            if field.is_empty() {
                return Err(ApiError::BadRequest(format!("invalid field selector: {term:?}: empty field")));
            }
            requirements.push(FieldRequirement {
                path: field.split('.').map(str::to_owned).collect(),
                value: unescape(term[at + len..].trim()),
                negate,
            });
        }
        Ok(Self { requirements })
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.requirements.iter().all(|r| {
            let mut cursor = Some(object);
            for segment in &r.path {
                cursor = cursor.and_then(|c| c.get(segment));
            }
            let actual = match cursor {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            (actual == r.value) != r.negate
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}, "spec": {"nodeName": "n1"}})
    }

    #[test]
    fn label_selector_operators() {
        let o = obj(json!({"app": "web", "tier": "front", "n": "5"}));
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m(""));
        assert!(m("app=web"));
        assert!(m("app==web"));
        assert!(!m("app!=web"));
        assert!(m("missing!=web"));
        assert!(m("app in (web, db)"));
        assert!(!m("app notin (web,db)"));
        assert!(m("missing notin (web)"));
        assert!(m("app"));
        assert!(!m("!app"));
        assert!(m("!service.kubernetes.io/headless"));
        assert!(m("app=web,tier=front"));
        assert!(!m("app=web,tier=back"));
        assert!(m("n>4,n<6"));
        assert!(m("app in (web),!service.kubernetes.io/service-proxy-name,tier"));
    }

    #[test]
    fn label_selector_rejects_garbage() {
        for bad in ["app in web", "=x", "app=web,", "app in (web", "n > x"] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn field_selector() {
        let o = obj(json!({}));
        let m = |s: &str| FieldSelector::parse(s).unwrap().matches(&o);
        assert!(m("metadata.name=a"));
        assert!(m("metadata.name==a,metadata.namespace=ns"));
        assert!(!m("metadata.name!=a"));
        assert!(m("spec.nodeName=n1"));
        assert!(m("status.phase="));
        assert!(!m("spec.nodeName="));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
