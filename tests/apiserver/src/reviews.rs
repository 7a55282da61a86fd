//! TokenReview (authentication.k8s.io/v1) and SubjectAccessReview (authorization.k8s.io/v1),
//! answered from a configurable table: token → user (and groups), and which user may do which
//! verb on which resource. Just enough of the API server's delegated authentication for a
//! client that authenticates callers with the real review requests.

use std::collections::{BTreeMap, BTreeSet};

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

pub(crate) const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
pub(crate) const SUBJECT_ACCESS_REVIEWS: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

#[derive(Default)]
pub(crate) struct Reviews {
    /// token → (username, groups)
    pub tokens: BTreeMap<String, (String, Vec<String>)>,
    /// (user, verb, group, resource) granted.
    pub allowed: BTreeSet<(String, String, String, String)>,
    /// Reviews answered: (token reviews, subject access reviews).
    pub counts: (u64, u64),
}

fn invalid(message: &str) -> Response {
    let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": "BadRequest", "code": 400});
    (StatusCode::BAD_REQUEST, Json(status)).into_response()
}

/// Answers a review; the request body comes back with `status` filled in.
pub(crate) fn answer(reviews: &mut Reviews, path: &str, body: &[u8]) -> Response {
    let Ok(mut review) = serde_json::from_slice::<Value>(body) else {
        return invalid("the review is not JSON");
    };
    let status = if path == TOKEN_REVIEWS {
        reviews.counts.0 += 1;
        let token = review.pointer("/spec/token").and_then(Value::as_str).unwrap_or_default();
        match reviews.tokens.get(token) {
            Some((user, groups)) => json!({"authenticated": true, "user": {"username": user, "groups": groups}}),
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
        }
    } else {
        reviews.counts.1 += 1;
        let field = |p: &str| review.pointer(p).and_then(Value::as_str).unwrap_or_default().to_string();
        let key = (
            field("/spec/user"),
            field("/spec/resourceAttributes/verb"),
            field("/spec/resourceAttributes/group"),
            field("/spec/resourceAttributes/resource"),
        );
        if reviews.allowed.contains(&key) {
            json!({"allowed": true, "reason": "allowed by the test table"})
        } else {
            json!({"allowed": false, "reason": format!("no rule lets {:?} {} {}.{}", key.0, key.1, key.3, key.2)})
        }
    };
    review["status"] = status;
    (StatusCode::CREATED, Json(review)).into_response()
}
