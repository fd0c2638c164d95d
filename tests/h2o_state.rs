//! The H2O state through the safe API on the default model: a session created with an
//! `H2oConfig` holds validated, allocated, empty state that can be inspected; bad parameters and
//! bad introspection requests are typed errors; and until the sparse prefill exists the session
//! refuses to evaluate rather than run full attention under an H2O label.
#![cfg(not(feature = "stock"))]

mod common;

use h2o_llama::{Error, H2oConfig, H2oError, Session, SessionConfig};

fn h2o_config(local: u32, heavy: u32) -> SessionConfig {
    SessionConfig {
        n_ctx: 2048,
        n_batch: 1024,
        n_ubatch: 256,
        n_threads: 2,
        h2o: Some(H2oConfig { local, heavy }),
        ..SessionConfig::default()
    }
}

#[test]
fn h2o_session_allocates_empty_state_of_the_model_shape() {
    let m = common::model();
    let s = Session::new(m, h2o_config(64, 96)).unwrap();
    let st = s.h2o_state().expect("H2O state");
    assert_eq!(
        (st.local, st.heavy, st.memory_size, st.chunk_size),
        (64, 96, 160, 256)
    );
    assert_eq!(
        (st.n_layer, st.n_head, st.kv_size),
        (m.n_layer(), m.n_head(), s.n_ctx())
    );
    assert_eq!(
        (st.chunks_done, st.tokens_done, st.memory_initialized),
        (0, 0, false)
    );
    // BF16 scores [kv_size, n_head] + I32 indices [M, n_head], per layer
    let per_layer = u64::from(st.n_head) * (u64::from(st.kv_size) * 2 + 160 * 4);
    assert_eq!(st.size_bytes, u64::from(st.n_layer) * per_layer);

    for (layer, head) in [(0, 0), (29, 8), (13, 4)] {
        let mem = s.h2o_memory_set(layer, head).unwrap();
        assert_eq!(mem.slots, vec![-1; 160], "layer {layer} head {head}");
        let scores = s.h2o_scores(layer, head, 0..st.kv_size).unwrap();
        assert!(
            scores.iter().all(|&x| x == 0.0),
            "layer {layer} head {head}"
        );
    }
}

#[test]
fn h2o_introspection_errors_are_typed() {
    let m = common::model();
    let s = Session::new(m, h2o_config(32, 32)).unwrap();
    let kv = s.h2o_state().unwrap().kv_size;
    let cases: Vec<(Error, H2oError)> = vec![
        (
            s.h2o_memory_set(30, 0).unwrap_err(),
            H2oError::InvalidLayer {
                layer: 30,
                n_layer: 30,
            },
        ),
        (
            s.h2o_memory_set(0, 9).unwrap_err(),
            H2oError::InvalidHead { head: 9, n_head: 9 },
        ),
        (
            s.h2o_scores(0, 0, 0..kv + 1).unwrap_err(),
            H2oError::InvalidRange {
                start: 0,
                end: u64::from(kv) + 1,
                kv_size: kv,
            },
        ),
    ];
    for (err, expected) in cases {
        assert!(
            matches!(&err, Error::H2o(e) if *e == expected),
            "{err:?} != {expected:?}"
        );
        assert!(!err.to_string().is_empty());
    }

    let plain = Session::new(
        m,
        SessionConfig {
            h2o: None,
            ..h2o_config(0, 0)
        },
    )
    .unwrap();
    assert!(plain.h2o_state().is_none());
    assert!(matches!(
        plain.h2o_memory_set(0, 0),
        Err(Error::H2o(H2oError::Disabled))
    ));
}

#[test]
fn h2o_parameters_are_validated() {
    let m = common::model();
    for (local, heavy, needle) in [
        (128, 128, "must be smaller than the chunk size -ub 256"),
        (0, 256, "must be smaller than the chunk size -ub 256"),
        (u32::MAX, 1, "must be smaller than the chunk size"),
    ] {
        let err = Session::new(m, h2o_config(local, heavy)).unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig(_)),
            "L {local} H {heavy}: {err}"
        );
        assert!(
            err.to_string().contains(needle),
            "L {local} H {heavy}: {err}"
        );
    }
    // local-only and heavy-only memories are valid
    assert!(Session::new(m, h2o_config(255, 0))
        .unwrap()
        .h2o_state()
        .is_some());
    assert!(Session::new(m, h2o_config(0, 255))
        .unwrap()
        .h2o_state()
        .is_some());
}

#[test]
fn h2o_session_does_not_pretend_to_prefill() {
    let m = common::model();
    let mut s = Session::new(m, h2o_config(64, 64)).unwrap();
    let tokens = m.tokenize("The capital of France is", true, true).unwrap();
    let err = s.evaluate(&tokens).unwrap_err();
    assert!(matches!(err, Error::H2oPrefillUnavailable { .. }), "{err}");
    assert!(err.to_string().contains("not implemented"), "{err}");
    assert_eq!(s.n_past(), 0);
}
