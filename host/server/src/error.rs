//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` under the status
//! code OpenAI's API uses for the case, with `Retry-After` where retrying later helps.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code.
    pub code: Option<&'static str>,
    /// Seconds to send as `Retry-After`.
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request is wrong; `param` names the field.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            param: param.map(String::from),
            ..Self::new(StatusCode::BAD_REQUEST, message)
        }
    }

    /// 400 with code `context_length_exceeded`, `param` the prompt's field.
    pub fn too_long(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            ..Self::invalid(Some(param), message)
        }
    }

    /// 401: a missing or wrong API key.
    pub fn unauthorized() -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            )
        }
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("no route {path}"))
    }

    /// A route asked with a method it does not take (405).
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{path} does not take {method}"),
        )
    }

    /// 404: a model this server does not serve.
    pub fn not_found_model(id: &str) -> Self {
        ApiError {
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..Self::new(
                StatusCode::NOT_FOUND,
                format!("the model '{id}' does not exist on this server"),
            )
        }
    }

    /// 404: no stored response `id` (never stored, expired, or deleted).
    pub fn not_found_response(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("no stored response '{id}' (it was not stored, has expired or was deleted)"),
        )
    }

    /// 429: the server's queue is full; retry after `seconds`.
    pub fn busy(message: impl Into<String>, seconds: u64) -> Self {
        ApiError {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(seconds),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// 503: the server cannot take the request now; retry after `seconds`.
    pub fn unavailable(message: impl Into<String>, seconds: u64) -> Self {
        ApiError {
            retry_after: Some(seconds),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
        }
    }

    /// 500: the model or the backend failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// With another status (a rejected body: 400, 413, 415).
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, message)
    }

    /// The OpenAI error `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            429 => "rate_limit_error",
            500.. => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error object.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}
