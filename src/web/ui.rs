//! The operator console: three files embedded in the binary, served under `/ui/`.
//!
//! They hold no data, so they are served to anyone who can reach the scope: the page asks for a
//! token when the API answers 401, and every read and write it makes is judged as any other.

use actix_web::{
    HttpResponse,
    http::header::{self, HeaderValue},
    web,
};

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");

/// The console's own files and the API, nothing else: no inline script, no other origin, no
/// framing.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                      connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                      form-action 'none'; frame-ancestors 'none'";

/// The console's routes, relative to the scope.
pub(crate) fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(web::resource("/ui").get(to_slash))
        .service(web::resource("/ui/").get(|| file(INDEX, "text/html; charset=utf-8")))
        .service(web::resource("/ui/app.js").get(|| file(SCRIPT, "text/javascript; charset=utf-8")))
        .service(web::resource("/ui/app.css").get(|| file(STYLE, "text/css; charset=utf-8")));
}

/// `ui` → `ui/`: the page's relative paths (its files, and the API at `../`) need the slash.
async fn to_slash() -> HttpResponse {
    HttpResponse::PermanentRedirect()
        .insert_header((header::LOCATION, "ui/"))
        .finish()
}

async fn file(body: &'static str, content_type: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, content_type))
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(POLICY),
        ))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        // A new build's console is picked up at the next load.
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(body)
}

#[cfg(test)]
mod tests {
    use actix_web::{App, http::StatusCode, test as web_test};

    use crate::{Store, web::Api};

    #[test]
    fn the_console_is_served_under_the_scope_and_ui_gains_its_slash() {
        let api = Api::new(Store::open(":memory:").unwrap())
            .token("alice", "a-token-of-the-tests")
            .unwrap();
        actix_rt::System::new().block_on(async move {
            let app = web_test::init_service(App::new().service(api.scope("/ops"))).await;
            let get = |path: &str| web_test::TestRequest::get().uri(path).to_request();

            let moved = web_test::call_service(&app, get("/ops/ui")).await;
            assert_eq!(moved.status(), StatusCode::PERMANENT_REDIRECT);
            assert_eq!(moved.headers().get("location").unwrap(), "ui/");

            for (path, kind, start) in [
                ("/ops/ui/", "text/html", "<!doctype html>"),
                (
                    "/ops/ui/app.js",
                    "text/javascript",
                    "// The agentrt operator console",
                ),
                ("/ops/ui/app.css", "text/css", "/* The agentrt console"),
            ] {
                let served = web_test::call_service(&app, get(path)).await;
                assert_eq!(served.status(), StatusCode::OK, "{path}");
                let headers = served.headers().clone();
                assert!(
                    headers
                        .get("content-type")
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .starts_with(kind)
                );
                let policy = headers
                    .get("content-security-policy")
                    .unwrap()
                    .to_str()
                    .unwrap();
                assert!(policy.contains("connect-src 'self'"), "{policy}");
                let body = web_test::read_body(served).await;
                assert!(body.starts_with(start.as_bytes()), "{path}");
            }
        });
    }

    /// The console's list of states (its filter, its badges) and the OpenAPI document's are
    /// the runtime's, in its order.
    #[test]
    fn the_console_and_the_api_document_know_every_run_state() {
        let all: Vec<&str> = crate::RunState::ALL.iter().map(|s| s.as_str()).collect();
        let line = super::SCRIPT
            .lines()
            .find_map(|line| line.trim_start().strip_prefix("const STATES = "))
            .expect("app.js declares its STATES");
        let states: Vec<String> = serde_json::from_str(line.trim_end_matches(';')).unwrap();
        assert_eq!(states, all, "app.js's STATES");
        let document: serde_json::Value = serde_json::from_str(crate::web::OPENAPI).unwrap();
        assert_eq!(
            document["components"]["schemas"]["RunState"]["enum"],
            serde_json::json!(all),
            "openapi.json's RunState"
        );
    }
}
