//! The seccomp filter of sandboxed code: a deny list of system calls that model-written code never
//! needs and that are the usual ways out of a namespace sandbox (tracing, mounting, kernel modules,
//! BPF, keyrings, new namespaces, io_uring). Everything else is allowed: the namespaces, the
//! unprivileged uid and the read-only view already confine what the allowed calls can reach, and a
//! deny list keeps interpreters and their native libraries working unchanged.
//!
//! The filter is a classic BPF program built once per run in the parent (the child only installs it).

use libc::{c_long, sock_filter};

/// The architecture the filter is built for, as `seccomp_data.arch` reports it. A system call made with
/// another ABI (for instance 32-bit `int 0x80` on x86-64) kills the process, so the numbers below cannot
/// be sidestepped by switching ABI.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E; // AUDIT_ARCH_X86_64
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7; // AUDIT_ARCH_AARCH64

/// Whether a filter exists for this architecture.
pub(super) const SUPPORTED: bool = cfg!(any(target_arch = "x86_64", target_arch = "aarch64"));

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD (0) | BPF_W (0) | BPF_ABS (0x20)
const BPF_JEQ_K: u16 = 0x05 | 0x10; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_JGE_K: u16 = 0x05 | 0x30; // BPF_JMP | BPF_JGE | BPF_K
const BPF_JSET_K: u16 = 0x05 | 0x40; // BPF_JMP | BPF_JSET | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K

// Offsets into `struct seccomp_data { int nr; u32 arch; u64 ip; u64 args[6]; }` (little endian: the
// low 32 bits of args[0] are at 16).
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;
const OFFSET_ARG0_LOW: u32 = 16;

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

/// `clone` flags that create namespaces: denied, so code cannot build a user namespace of its own in
/// which it would hold capabilities again.
const CLONE_NEW_ANY: u32 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | 0x80/* CLONE_NEWTIME */) as u32;

/// System calls that fail with `EPERM`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const DENIED: &[c_long] = &[
    // Tracing and reading or writing other processes' memory.
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kcmp,
    libc::SYS_pidfd_getfd,
    // Mounts, new roots and namespaces.
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    // The kernel itself: modules, kexec, BPF, perf, keyrings, swap, reboot, clocks, accounting.
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_vhangup,
    libc::SYS_personality,
    // Interfaces with a long record of privilege escalations, not needed by ordinary code.
    libc::SYS_userfaultfd,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_fanotify_init,
    libc::SYS_lookup_dcookie,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_uselib,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_modify_ldt,
];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const DENIED: &[c_long] = &[];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const AUDIT_ARCH: u32 = 0;

fn statement(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// The filter program: check the ABI, deny the calls of [`DENIED`], deny `clone` with namespace flags,
/// make `clone3` unavailable (its flags are behind a pointer the filter cannot read; C libraries fall
/// back to `clone`), allow the rest.
pub(super) fn filter() -> Vec<sock_filter> {
    let eperm = RET_ERRNO | libc::EPERM as u32;
    let mut program = vec![
        statement(BPF_LD_W_ABS, OFFSET_ARCH),
        jump(BPF_JEQ_K, AUDIT_ARCH, 1, 0),
        statement(BPF_RET_K, RET_KILL_PROCESS),
        statement(BPF_LD_W_ABS, OFFSET_NR),
    ];
    #[cfg(target_arch = "x86_64")]
    {
        // The x32 ABI shares AUDIT_ARCH_X86_64 and marks its numbers with bit 30.
        program.push(jump(BPF_JGE_K, 0x4000_0000, 0, 1));
        program.push(statement(BPF_RET_K, eperm));
    }
    for &number in DENIED {
        program.push(jump(BPF_JEQ_K, number as u32, 0, 1));
        program.push(statement(BPF_RET_K, eperm));
    }
    program.push(jump(BPF_JEQ_K, libc::SYS_clone3 as u32, 0, 1));
    program.push(statement(BPF_RET_K, RET_ERRNO | libc::ENOSYS as u32));
    program.push(jump(BPF_JEQ_K, libc::SYS_clone as u32, 0, 3));
    program.push(statement(BPF_LD_W_ABS, OFFSET_ARG0_LOW));
    program.push(jump(BPF_JSET_K, CLONE_NEW_ANY, 0, 1));
    program.push(statement(BPF_RET_K, eperm));
    program.push(statement(BPF_RET_K, RET_ALLOW));
    program
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny interpreter of the subset of classic BPF the filter uses, to check its decisions
    /// without installing it.
    fn decide(program: &[sock_filter], arch: u32, nr: u32, arg0: u32) -> u32 {
        let mut accumulator = 0u32;
        let mut pc = 0usize;
        loop {
            let instruction = program[pc];
            match instruction.code {
                BPF_LD_W_ABS => {
                    accumulator = match instruction.k {
                        OFFSET_NR => nr,
                        OFFSET_ARCH => arch,
                        OFFSET_ARG0_LOW => arg0,
                        other => panic!("load of offset {other}"),
                    }
                }
                BPF_JEQ_K | BPF_JGE_K | BPF_JSET_K => {
                    let taken = match instruction.code {
                        BPF_JEQ_K => accumulator == instruction.k,
                        BPF_JGE_K => accumulator >= instruction.k,
                        _ => accumulator & instruction.k != 0,
                    };
                    pc += if taken {
                        instruction.jt as usize
                    } else {
                        instruction.jf as usize
                    };
                }
                BPF_RET_K => return instruction.k,
                other => panic!("opcode {other:#x}"),
            }
            pc += 1;
        }
    }

    #[test]
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn decisions() {
        let program = filter();
        assert!(program.len() < 4096);
        let eperm = RET_ERRNO | libc::EPERM as u32;
        let call = |nr: c_long, arg0: u32| decide(&program, AUDIT_ARCH, nr as u32, arg0);
        assert_eq!(call(libc::SYS_read, 0), RET_ALLOW);
        assert_eq!(call(libc::SYS_getpid, 0), RET_ALLOW);
        for &denied in DENIED {
            assert_eq!(call(denied, 0), eperm, "{denied}");
        }
        assert_eq!(call(libc::SYS_ptrace, 0), eperm);
        assert_eq!(call(libc::SYS_mount, 0), eperm);
        // fork-style clone is allowed; a clone that makes a user or PID namespace is not.
        assert_eq!(call(libc::SYS_clone, libc::SIGCHLD as u32), RET_ALLOW);
        assert_eq!(
            call(
                libc::SYS_clone,
                (libc::CLONE_NEWUSER | libc::SIGCHLD) as u32
            ),
            eperm
        );
        assert_eq!(call(libc::SYS_clone, libc::CLONE_NEWPID as u32), eperm);
        assert_eq!(call(libc::SYS_clone3, 0), RET_ERRNO | libc::ENOSYS as u32);
        // Another ABI is killed outright.
        assert_eq!(
            decide(&program, 0x4000_0003, libc::SYS_read as u32, 0),
            RET_KILL_PROCESS
        );
        #[cfg(target_arch = "x86_64")]
        assert_eq!(call(0x4000_0000 | libc::SYS_read, 0), eperm);
    }
}
