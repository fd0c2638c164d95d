// Empty: this crate only exists so that `cargo vendor` can resolve the pinned upstream.
