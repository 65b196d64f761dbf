//! Job-file inputs of the fuzz target `job_file` (findings of `cargo fuzz run job_file`,
//! kept once fixed) in the normal test suite: each is refused with an error, never a
//! panic or a hang.

use cannabis_market::spec::JobSpec;

#[test]
fn every_kept_job_file_finding_is_refused_cleanly() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions/job_file");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
        assert!(
            JobSpec::parse(&text).is_err(),
            "{} was taken",
            path.display()
        );
        seen += 1;
    }
    assert!(seen > 0, "no regression inputs under {}", dir.display());
}
