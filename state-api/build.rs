// `sqlx::migrate!` embeds the migrations when the crate compiles, and cargo does not know it
// reads that folder: without this, a new migration is left out of an incremental build.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
