//! Opening a store by where it is: a path, `:memory:` or a URL, each handed to the backend
//! that serves it.
//!
//! A URL's scheme names its backend (`postgres://` and `postgresql://`: PostgreSQL); anything
//! else is an SQLite file's path, or `:memory:`. The backends' own code stays in their
//! modules: this one only routes, and says which cargo feature to enable when the backend a
//! location names is not compiled in.

use std::path::Path;

use super::Store;
use crate::error::{Error, Result};

/// A backend a location can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An SQLite file, or `:memory:`: whatever no scheme below claims.
    Sqlite,
    /// A PostgreSQL database.
    Postgres,
}

/// The URL schemes, with the backend each names.
const SCHEMES: &[(&str, Kind)] = &[
    ("postgres://", Kind::Postgres),
    ("postgresql://", Kind::Postgres),
];

impl Kind {
    /// The backend `location` names.
    pub(crate) fn of(location: &str) -> Kind {
        SCHEMES
            .iter()
            .find(|(scheme, _)| location.starts_with(scheme))
            .map_or(Kind::Sqlite, |&(_, kind)| kind)
    }

    /// The backend's name, for messages.
    #[cfg_attr(all(feature = "sqlite", feature = "postgres"), allow(dead_code))]
    fn name(self) -> &'static str {
        match self {
            Kind::Sqlite => "SQLite",
            Kind::Postgres => "PostgreSQL",
        }
    }

    /// The cargo feature that compiles the backend in.
    #[cfg_attr(all(feature = "sqlite", feature = "postgres"), allow(dead_code))]
    fn feature(self) -> &'static str {
        match self {
            Kind::Sqlite => "sqlite",
            Kind::Postgres => "postgres",
        }
    }

    /// The refusal of a location whose backend this build lacks.
    #[cfg_attr(all(feature = "sqlite", feature = "postgres"), allow(dead_code))]
    fn not_built(self, location: String) -> Error {
        Error::BackendNotBuilt {
            location,
            backend: self.name(),
            feature: self.feature(),
        }
    }
}

impl Store {
    /// Opens (creating it if missing) the SQLite database file at `path`, with the default
    /// [`sqlite::Options`](crate::sqlite::Options). A file that is not a database, a damaged
    /// one, or a database of a newer schema version is refused and left as it was.
    /// `":memory:"` is [`Store::in_memory`].
    ///
    /// Without the `sqlite` feature: [`Error::BackendNotBuilt`].
    pub fn open(path: impl AsRef<Path>) -> Result<Store> {
        sqlite(path.as_ref())
    }

    /// A new SQLite database in memory, gone with the last clone of this handle.
    ///
    /// Without the `sqlite` feature: [`Error::BackendNotBuilt`].
    pub fn in_memory() -> Result<Store> {
        sqlite(Path::new(":memory:"))
    }

    /// Opens the store at `location` with its backend's default options: a PostgreSQL
    /// database for a `postgres://` or `postgresql://` URL (see
    /// [`postgres::Options`](crate::postgres::Options)), else the SQLite file at that path,
    /// or `:memory:` ([`Store::open`]).
    ///
    /// A location whose backend this build lacks (its `postgres` or `sqlite` feature) is
    /// [`Error::BackendNotBuilt`].
    pub fn connect(location: &str) -> Result<Store> {
        match Kind::of(location) {
            Kind::Postgres => postgres(location),
            Kind::Sqlite => Store::open(location),
        }
    }
}

#[cfg(feature = "sqlite")]
fn sqlite(path: &Path) -> Result<Store> {
    super::sqlite::Options::default().open(path)
}

#[cfg(not(feature = "sqlite"))]
fn sqlite(path: &Path) -> Result<Store> {
    Err(Kind::Sqlite.not_built(path.display().to_string()))
}

#[cfg(feature = "postgres")]
fn postgres(url: &str) -> Result<Store> {
    super::postgres::Options::new().open(url)
}

#[cfg(not(feature = "postgres"))]
fn postgres(url: &str) -> Result<Store> {
    // The host and database only: the URL's user part may hold a password.
    let shown = url.split('@').next_back().unwrap_or(url);
    Err(Kind::Postgres.not_built(shown.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scheme_names_its_backend_and_anything_else_is_a_path() {
        for url in [
            "postgres://u@h/db",
            "postgresql://h/db",
            "postgres://u:secret@h:5432/db?options=-csearch_path%3Dx",
        ] {
            assert_eq!(Kind::of(url), Kind::Postgres, "{url}");
        }
        for path in [
            "agents.db",
            ":memory:",
            "/var/lib/postgres/agents.db",
            "postgres:/not-a-url",
            "POSTGRES://h/db",
            "sqlite://agents.db",
            "",
        ] {
            assert_eq!(Kind::of(path), Kind::Sqlite, "{path}");
        }
    }

    #[test]
    fn a_missing_backend_names_the_feature_to_enable() {
        let err = Kind::Postgres.not_built("h/db".into());
        assert!(matches!(
            err,
            Error::BackendNotBuilt {
                backend: "PostgreSQL",
                feature: "postgres",
                ..
            }
        ));
        assert_eq!(
            err.to_string(),
            "this build of agentrt has no PostgreSQL backend for \"h/db\": enable agentrt's cargo \
             feature `postgres`"
        );
        let err = Kind::Sqlite.not_built(":memory:".into());
        assert!(
            err.to_string()
                .ends_with("enable agentrt's cargo feature `sqlite`")
        );
    }

    #[cfg(not(feature = "postgres"))]
    #[test]
    fn a_postgres_url_without_the_feature_is_refused_without_its_password() {
        let err = Store::connect("postgres://agentrt:secret@db.internal/agents").unwrap_err();
        assert!(matches!(
            err,
            Error::BackendNotBuilt {
                feature: "postgres",
                ..
            }
        ));
        assert!(!err.to_string().contains("secret"), "{err}");
    }
}
