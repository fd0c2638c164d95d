//! Replays the corpus that fuzzing the saved-state readers keeps (`fuzz/corpus/saved_state/`,
//! `scripts/fuzz.sh`): every input, the cases that once crashed among them, must be read or
//! refused, never panic. The corpus starts from states of the default model saved by h2o-llama
//! and cut down to their first kilobytes, so these exercise every header the readers know.

#[test]
fn every_kept_input_is_read_or_refused() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/saved_state");
    let entries = std::fs::read_dir(&dir).expect("the corpus is kept in fuzz/corpus/saved_state");
    let mut n = 0;
    let mut accepted = 0;
    for e in entries {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        for n_ctx in [0, 8192, u32::MAX] {
            let [session, sequence] = h2o_llama::fuzzing::saved_state(&bytes, n_ctx);
            accepted += usize::from(session.is_ok()) + usize::from(sequence.is_ok());
        }
        n += 1;
    }
    assert!(n > 0, "the corpus is empty");
    eprintln!("{n} inputs, {accepted} readings accepted");
}
