//! The PostgreSQL backend's own tests: migrations and clock skew across processes, the client
//! inside actix, and the command line on a PostgreSQL URL.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "cli")]
mod postgres_cli;
mod postgres_clock_skew;
mod postgres_in_actix;
mod postgres_migrations;
