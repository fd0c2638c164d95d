//! A context's state streamed to a writer and back from a reader, piece by piece, so that a save or
//! a restore never holds a second copy of a state that reaches several GB at long contexts:
//! llama.cpp's `llama_state_write_stream` / `llama_state_read_stream` (our hook; the bytes are
//! those of `llama_state_get_data` and `llama_state_seq_get_data`) call back here with host
//! tensors in place and device tensors through a buffer of a few MiB.
//!
//! The pristine build (`stock`) has no such calls: it goes through one buffer of the whole state,
//! as llama.cpp's own API does.

use std::any::Any;
use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::ptr::NonNull;

use crate::backend;
use crate::sys;

/// Which state: the whole context's, or one sequence's.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Scope {
    Context,
    Seq(i32),
}

impl Scope {
    /// The sequence id of llama.cpp's stream calls: -1 for the whole context.
    #[cfg(not(feature = "stock"))]
    fn seq_id(self) -> i32 {
        match self {
            Scope::Context => -1,
            Scope::Seq(s) => s,
        }
    }
}

/// A callback's failure, kept until llama.cpp returns: an I/O error, or a panic to resume.
enum Failure {
    Io(io::Error),
    Panic(Box<dyn Any + Send>),
}

/// What a callback works with: the caller's closure and the first failure it met.
struct Callback<'a, F: ?Sized> {
    f: &'a mut F,
    failure: Option<Failure>,
}

impl<F: ?Sized> Callback<'_, F> {
    /// Runs the closure; a failure is kept and reported to llama.cpp as `false`.
    fn call(&mut self, run: impl FnOnce(&mut F) -> io::Result<()>) -> bool {
        if self.failure.is_some() {
            return false;
        }
        let f = &mut *self.f;
        match panic::catch_unwind(AssertUnwindSafe(|| run(f))) {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                self.failure = Some(Failure::Io(e));
                false
            }
            Err(p) => {
                self.failure = Some(Failure::Panic(p));
                false
            }
        }
    }

    /// llama.cpp's count of bytes, or why it is 0: the callback's own error first (it is what
    /// stopped llama.cpp), then llama.cpp's log.
    fn outcome(self, n: usize) -> Result<usize, String> {
        match self.failure {
            Some(Failure::Panic(p)) => panic::resume_unwind(p),
            Some(Failure::Io(e)) => Err(e.to_string()),
            None if n == 0 => Err(backend::recent_log_reason()),
            None => Ok(n),
        }
    }
}

type Sink<'a> = dyn FnMut(&[u8]) -> io::Result<()> + 'a;
type Source<'a> = dyn FnMut(&mut [u8]) -> io::Result<()> + 'a;

#[cfg(not(feature = "stock"))]
unsafe extern "C" fn write_piece(
    src: *const std::ffi::c_void,
    size: usize,
    user_data: *mut std::ffi::c_void,
) -> bool {
    // SAFETY: `user_data` is the `Callback` that `write` passed, alive for the call; llama.cpp
    // hands `size` readable bytes at `src`.
    let cb = unsafe { &mut *(user_data as *mut Callback<'_, Sink<'_>>) };
    let piece = unsafe { std::slice::from_raw_parts(src as *const u8, size) };
    cb.call(|f| f(piece))
}

#[cfg(not(feature = "stock"))]
unsafe extern "C" fn read_piece(
    dst: *mut std::ffi::c_void,
    size: usize,
    user_data: *mut std::ffi::c_void,
) -> bool {
    // SAFETY: as in `write_piece`; llama.cpp hands `size` writable bytes at `dst`.
    let cb = unsafe { &mut *(user_data as *mut Callback<'_, Source<'_>>) };
    let piece = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, size) };
    cb.call(|f| f(piece))
}

/// Hands the state of `scope` to `sink` in pieces; returns the bytes written. The error is the
/// sink's own, or llama.cpp's reason.
pub(crate) fn write(
    ctx: NonNull<sys::llama_context>,
    scope: Scope,
    sink: &mut Sink<'_>,
) -> Result<usize, String> {
    backend::clear_recent_log();
    let mut cb = Callback {
        f: sink,
        failure: None,
    };
    #[cfg(not(feature = "stock"))]
    let n = {
        // SAFETY: valid context; `cb` outlives the call and is only used through `write_piece`.
        unsafe {
            sys::llama_state_write_stream(
                ctx.as_ptr(),
                scope.seq_id(),
                Some(write_piece),
                &mut cb as *mut Callback<'_, Sink<'_>> as *mut std::ffi::c_void,
            )
        }
    };
    #[cfg(feature = "stock")]
    let n = {
        let bytes = whole_state(ctx, scope);
        if bytes.is_empty() || !cb.call(|f| f(&bytes)) {
            0
        } else {
            bytes.len()
        }
    };
    cb.outcome(n)
}

/// Fills the context (or sequence `scope`) with a state read from `source` in pieces; returns
/// the bytes read. A failure part-way leaves the memory (or the sequence) empty, as
/// `llama_state_set_data` does.
pub(crate) fn read(
    ctx: NonNull<sys::llama_context>,
    scope: Scope,
    source: &mut Source<'_>,
    #[cfg_attr(not(feature = "stock"), allow(unused_variables))] len: usize,
) -> Result<usize, String> {
    backend::clear_recent_log();
    let mut cb = Callback {
        f: source,
        failure: None,
    };
    #[cfg(not(feature = "stock"))]
    let n = {
        // SAFETY: valid context; `cb` outlives the call and is only used through `read_piece`.
        unsafe {
            sys::llama_state_read_stream(
                ctx.as_ptr(),
                scope.seq_id(),
                Some(read_piece),
                &mut cb as *mut Callback<'_, Source<'_>> as *mut std::ffi::c_void,
            )
        }
    };
    #[cfg(feature = "stock")]
    let n = {
        let mut bytes = vec![0u8; len];
        if !cb.call(|f| f(&mut bytes)) {
            0
        } else {
            // SAFETY: valid context; llama.cpp reads at most `bytes.len()` bytes.
            unsafe {
                match scope {
                    Scope::Context => {
                        sys::llama_state_set_data(ctx.as_ptr(), bytes.as_ptr(), bytes.len())
                    }
                    Scope::Seq(s) => {
                        sys::llama_state_seq_set_data(ctx.as_ptr(), bytes.as_ptr(), bytes.len(), s)
                    }
                }
            }
        }
    };
    cb.outcome(n)
}

/// The whole state in one buffer (empty when llama.cpp cannot give it): the pristine build's way.
#[cfg(feature = "stock")]
fn whole_state(ctx: NonNull<sys::llama_context>, scope: Scope) -> Vec<u8> {
    // SAFETY: valid context; the buffer has the size llama.cpp asked for.
    unsafe {
        let size = match scope {
            Scope::Context => sys::llama_state_get_size(ctx.as_ptr()),
            Scope::Seq(s) => sys::llama_state_seq_get_size(ctx.as_ptr(), s),
        };
        let mut bytes = vec![0u8; size];
        let n = match scope {
            Scope::Context => sys::llama_state_get_data(ctx.as_ptr(), bytes.as_mut_ptr(), size),
            Scope::Seq(s) => {
                sys::llama_state_seq_get_data(ctx.as_ptr(), bytes.as_mut_ptr(), size, s)
            }
        };
        bytes.truncate(if n > size { 0 } else { n });
        bytes
    }
}
