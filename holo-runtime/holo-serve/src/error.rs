//! Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}`.

use super::*;

#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) kind: &'static str,
    pub(super) param: Option<String>,
    pub(super) code: Option<&'static str>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            param: None,
            code: None,
        }
    }

    /// A 400 about one field.
    pub(super) fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, message)
            .param(param)
            .code("invalid_value")
    }

    pub(super) fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub(super) fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub(super) fn from_sampler(error: SamplerError) -> Self {
        match error {
            SamplerError::Rejected(message) => ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("the sampler rejected the request: {message}"),
            )
            .code("sampler_rejected"),
            SamplerError::Unavailable(message) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the sampler is unavailable: {message}"),
            )
            .code("sampler_unavailable"),
            SamplerError::Malformed(message) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the sampler failed: {message}"),
            )
            .code("sampler_error"),
            SamplerError::Overloaded(message) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the server is busy, retry later: {message}"),
            )
            .code("server_overloaded"),
        }
    }
}

impl ApiError {
    /// `{"error": {"message", "type", "param", "code"}}`, the body of an error response or chunk.
    pub(super) fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // A full queue drains in about a second at the speeds this server runs at.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of the body may still come: the connection cannot carry another request.
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

/// A JSON value in an error message: short values as they are, others by kind.
pub(super) fn describe(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() <= 40 {
        return text;
    }
    match value {
        Value::String(_) => "a long string".into(),
        Value::Array(items) => format!("a list of {} items", items.len()),
        Value::Object(_) => "an object".into(),
        _ => text.chars().take(40).collect(),
    }
}
