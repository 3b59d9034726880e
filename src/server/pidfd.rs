//! A handle on the process at the other end of a Unix-socket connection (`SO_PEERPIDFD`,
//! Linux 6.5 and later): unlike its pid, it cannot come to name another process, so a
//! connection that outlives its process (inherited by a child, its pid reused) is told apart
//! without racing the reuse.
//!
//! # Invariants
//! - A [`PidFd`] is the kernel's handle of the process that connected, taken when the agent
//!   accepted; it polls readable once that process has exited, reaped or not.
//! - Whether the kernel gives handles at all is asked once, of a socket pair of the agent's
//!   own. Where it gives none (before Linux 6.5, an architecture whose option number is not
//!   the generic one), callers fall back to the start time read at the accept, and the race
//!   remains: a process that connected and was reaped, its pid reused, before the accept is
//!   taken for the new one. Where it does, a peer it gives no handle for is unproven.
//! - A handle is a descriptor, held as long as its connection: [`raise_open_files`] lifts the
//!   agent's soft limit of open files to its hard one (at most [`MAX_OPEN_FILES`]), so the
//!   listeners' connections and their handles stay within it.
//! - The calls below are the only `unsafe` here: each passes the kernel a buffer of the size
//!   it says, and takes ownership of a descriptor only when the kernel returned one.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `SO_PEERPIDFD` in the kernel's generic socket options (x86, Arm, RISC-V and most others);
/// the architectures with their own numbering get none.
#[cfg(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    ))
))]
const SO_PEERPIDFD: Option<libc::c_int> = Some(77);
#[cfg(not(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    ))
)))]
const SO_PEERPIDFD: Option<libc::c_int> = None;

/// The process handle of a socket's peer.
#[derive(Debug)]
pub struct PidFd(OwnedFd);

/// What the kernel says of a socket peer's process.
#[derive(Debug)]
pub enum PeerHandle {
    /// Its handle.
    Held(PidFd),
    /// The kernel gives handles but none for this peer: the process has gone (reaped
    /// before the accept); nothing is proven then.
    Gone,
    /// This kernel or platform gives no handles.
    Unsupported,
}

impl PidFd {
    /// The handle of the process that connected `socket`, where the kernel gives one. Where
    /// it gives handles at all ([`supported`]), any failure for this peer means it has none
    /// to give (kernels before 6.16 refuse one for a process already reaped, with `EINVAL`).
    pub fn of_peer(socket: &impl AsRawFd) -> PeerHandle {
        if !supported() {
            return PeerHandle::Unsupported;
        }
        match peer_pidfd(socket) {
            Some(handle) => PeerHandle::Held(handle),
            None => PeerHandle::Gone,
        }
    }

    /// Whether its process has exited (or the kernel cannot say: nothing is proven then).
    #[allow(unsafe_code)]
    pub fn exited(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one `pollfd`, alive for the call; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&raw mut poll, 1, 0) };
        ready != 0
    }
}

/// The most open files [`raise_open_files`] asks for.
pub const MAX_OPEN_FILES: u64 = 65_536;

/// Raises this process's soft limit of open files to its hard limit, at most
/// [`MAX_OPEN_FILES`]: each socket connection holds a second descriptor (its peer's handle),
/// and two listeners of 384 connections with those handles pass the usual soft limit of
/// 1 024. Where the limit cannot be read or raised it stays as it is.
#[allow(unsafe_code)]
pub fn raise_open_files() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` outlives both calls; the kernel reads or writes only it.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) == 0 {
            let wanted = limit.rlim_max.min(MAX_OPEN_FILES);
            if limit.rlim_cur < wanted {
                limit.rlim_cur = wanted;
                libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit);
            }
        }
    }
}

/// Whether this kernel gives peers' handles: asked once, of a socket pair of this process's
/// own (whose peer is alive), so that a failure for a real peer is never taken for a kernel
/// without the option.
fn supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        std::os::unix::net::UnixStream::pair()
            .is_ok_and(|(ours, _theirs)| peer_pidfd(&ours).is_some())
    })
}

/// The kernel's handle of `socket`'s peer (`SO_PEERPIDFD`), if it gives one.
#[allow(unsafe_code)]
fn peer_pidfd(socket: &impl AsRawFd) -> Option<PidFd> {
    let option = SO_PEERPIDFD?;
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` and `len` outlive the call, and `len` is `fd`'s size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&raw mut fd).cast(),
            &raw mut len,
        )
    };
    // SAFETY: on success the kernel made `fd`, a descriptor no one else owns.
    (rc == 0 && fd >= 0).then(|| PidFd(unsafe { OwnedFd::from_raw_fd(fd) }))
}

#[cfg(test)]
mod tests {
    use super::{PeerHandle, PidFd};

    /// A peer's handle says alive while it runs and exited once it has gone, reaped or not.
    #[test]
    fn a_peer_handle_follows_its_process() {
        let dir = std::env::temp_dir().join(format!("gpumem-pidfd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let path = dir.join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("binds");
        // This process as a peer: alive.
        let _own = std::os::unix::net::UnixStream::connect(&path).expect("connects");
        let (accepted, _) = listener.accept().expect("accepts");
        let PeerHandle::Held(handle) = PidFd::of_peer(&accepted) else {
            panic!("this kernel gives no SO_PEERPIDFD (Linux 6.5+ expected on the test machines)");
        };
        assert!(!handle.exited());
        // A child that connects, then exits and is reaped.
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); sys.stdin.readline()",
            ])
            .arg(&path)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let (accepted, _) = listener.accept().expect("accepts");
        let PeerHandle::Held(handle) = PidFd::of_peer(&accepted) else {
            panic!("a handle of the child");
        };
        assert!(!handle.exited(), "the child still runs");
        drop(child.stdin.take());
        assert!(child.wait().expect("exits").success());
        assert!(handle.exited(), "the child has exited");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
