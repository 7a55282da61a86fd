//! Errors of the test API server and their wire form, a `kind: Status` object.
//!
//! kube decides what to do with a failed request from the Status body (`code` and
//! `reason`: `is_not_found`, `is_conflict`, `is_already_exists`, ...), so every error
//! maps to the same code, reason and message wording a real API server uses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// A failed API operation, over HTTP or through the test-control methods.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The object (or the resource type) does not exist.
    #[error("{resource} \"{name}\" not found")]
    NotFound { resource: String, name: String },
    /// No such path or resource type.
    #[error("the server could not find the requested resource ({0})")]
    PathNotFound(String),
    /// Create of an object whose name is taken.
    #[error("{resource} \"{name}\" already exists")]
    AlreadyExists { resource: String, name: String },
    /// Optimistic concurrency failure: a stale `resourceVersion` (or uid precondition).
    #[error(
        "Operation cannot be fulfilled on {resource} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
    )]
    Conflict { resource: String, name: String },
    /// A malformed request: bad selector, bad body, bad continue token.
    #[error("{0}")]
    BadRequest(String),
    /// A well-formed request that the object rules reject (missing name, failed JSON-patch test).
    #[error("{0}")]
    Invalid(String),
    /// A verb the path does not support (e.g. POST to an object path).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// A patch content type the server does not know.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// A `continue` token whose snapshot is gone (compacted). Real servers answer 410 here.
    #[error("{0}")]
    Expired(String),
    /// The server was switched to unavailable by the test.
    #[error("the server is currently unable to handle the request")]
    Unavailable,
}

impl ApiError {
    pub(crate) fn not_found(resource: impl Into<String>, name: impl Into<String>) -> Self {
        Self::NotFound { resource: resource.into(), name: name.into() }
    }

    /// HTTP status code, as a real API server would answer.
    pub fn code(&self) -> u16 {
        match self {
            Self::NotFound { .. } | Self::PathNotFound(_) => 404,
            Self::AlreadyExists { .. } | Self::Conflict { .. } => 409,
            Self::BadRequest(_) => 400,
            Self::Invalid(_) => 422,
            Self::MethodNotAllowed(_) => 405,
            Self::UnsupportedMediaType(_) => 415,
            Self::Expired(_) => 410,
            Self::Unavailable => 503,
        }
    }

    /// The `reason` field of the Status, one of Kubernetes' `metav1.StatusReason` values.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound { .. } | Self::PathNotFound(_) => "NotFound",
            Self::AlreadyExists { .. } => "AlreadyExists",
            Self::Conflict { .. } => "Conflict",
            Self::BadRequest(_) => "BadRequest",
            Self::Invalid(_) => "Invalid",
            Self::MethodNotAllowed(_) => "MethodNotAllowed",
            Self::UnsupportedMediaType(_) => "UnsupportedMediaType",
            Self::Expired(_) => "Expired",
            Self::Unavailable => "ServiceUnavailable",
        }
    }

    /// The `kind: Status` body.
    pub fn to_status(&self) -> Value {
        let mut status = failure_status(self.code(), self.reason(), &self.to_string());
        if let Self::NotFound { resource, name }
        | Self::AlreadyExists { resource, name }
        | Self::Conflict { resource, name } = self
        {
            // `details.kind` is the plural resource name in real responses, the group its suffix.
            let (kind, group) = resource.split_once('.').unwrap_or((resource, ""));
            status["details"] = json!({ "name": name, "group": group, "kind": kind });
        }
        status
    }
}

/// A `status: Failure` Status object; also the object of an in-stream watch ERROR event.
pub(crate) fn failure_status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(self.to_status())).into_response()
    }
}
