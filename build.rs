//! Embeds every `migrations/NNNN_*.sql` file, in order, so that adding a migration is adding a
//! file: the generated list is what `store::migrations()` applies.

use std::{env, fs, path::Path};

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    let dir = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join("migrations");
    let mut files: Vec<_> = fs::read_dir(&dir)
        .expect("migrations/ is readable")
        .map(|entry| entry.expect("migrations/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
        .collect();
    files.sort();

    let mut out = String::from("/// The migrations in `migrations/`, in the order they apply.\n");
    out.push_str("pub(crate) const MIGRATIONS: &[(&str, &str)] = &[\n");
    for (index, path) in files.iter().enumerate() {
        let name = path.file_name().unwrap().to_str().unwrap();
        let expected = format!("{:04}_", index + 1);
        assert!(
            name.starts_with(&expected),
            "migration {name} should start with {expected}: versions are gapless"
        );
        out.push_str(&format!(
            "    ({name:?}, include_str!({:?})),\n",
            path.display().to_string()
        ));
    }
    out.push_str("];\n");
    fs::write(
        Path::new(&env::var("OUT_DIR").unwrap()).join("migrations.rs"),
        out,
    )
    .unwrap();
}
