/* Preloaded into the commands of a gVisor (runsc) box by corral.
 *
 * runsc releases before 2023 fail statx(2) and newfstatat(2) with EINVAL when the flags hold
 * AT_NO_AUTOMOUNT, which `ls -l`, `stat` and gnulib's fstatat pass. gVisor has no automount
 * points, so the flag means nothing there: these wrappers drop it and make the system call.
 * Nothing here is a security boundary (a command may unset LD_PRELOAD); it is compatibility.
 */
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <unistd.h>

#define NO_AUTOMOUNT 0x800

int statx(int dirfd, const char *path, int flags, unsigned int mask, void *buf)
{
    return (int)syscall(SYS_statx, dirfd, path, flags & ~NO_AUTOMOUNT, mask, buf);
}

int fstatat(int dirfd, const char *path, void *buf, int flags)
{
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~NO_AUTOMOUNT);
}

int fstatat64(int dirfd, const char *path, void *buf, int flags)
{
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~NO_AUTOMOUNT);
}

/* Binaries linked against glibc before 2.33 call these instead. */
int __fxstatat(int ver, int dirfd, const char *path, void *buf, int flags)
{
    (void)ver;
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~NO_AUTOMOUNT);
}

int __fxstatat64(int ver, int dirfd, const char *path, void *buf, int flags)
{
    (void)ver;
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~NO_AUTOMOUNT);
}
