/* cellgate-runner, native: the resident runner of sandbox/client/cellgate_runner.py
 * (F2), the same protocol and the same behaviour, without a Python to start: a pooled
 * sandbox starts its runner at its claim, and 64 claims at once share two cores (F3).
 *
 * Started once per sandbox as the sandbox's user, with its environment and working
 * directory; it connects to the gateway's socket (the last argument that is a path,
 * else SOCKET) and runs one
 * request at a time, as `timeout -k 2 <s> <command>` would: the command in a session
 * of its own, the request's environment (then the exec marker) over the runner's, its
 * working directory, stdin written then closed, stdout and stderr kept up to the
 * request's cap (the rest read and dropped); after <s> whole seconds its process group
 * gets SIGTERM (and SIGCONT), 2 s later SIGKILL, and the exit code is then 124 or 137;
 * past the deadline its group and every process carrying the marker are killed.
 *
 * Frames both ways: a 4-byte big-endian length, a header, then raw bytes (the request's
 * stdin; the reply's stdout then stderr). The request's header is NUL-terminated fields
 * (see `runner_client.encode_request`); the reply's is JSON. The gateway treats
 * everything this process sends as hostile; this process trusts the gateway.
 *
 * Build: scripts/build-runner.sh (a static binary: it runs in any image of the host's
 * architecture, whatever its libc). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SOCKET "/run/cellgate/runner.sock"
#define MAX_HEADER (1024 * 1024)
#define MAX_STDIN (64 * 1024 * 1024)
#define MAX_FIELDS 65536
#define KILL_AFTER 2.0
#define GRACE 1.0
#define AFTER_EXIT 0.05
#define CONNECT_WAIT 5.0
#define CHUNK 65536
#define MAX_ENVIRON_READ (1 << 20)

extern char **environ;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* n bytes from fd into buf; 0 on success, -1 on EOF or error */
static int read_exact(int fd, char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

static int write_all(int fd, const char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

/* a growable byte buffer that keeps at most `cap` bytes */
struct buf {
    char *data;
    size_t len, cap;
};

static void keep(struct buf *b, const char *chunk, size_t n) {
    size_t room = b->cap - b->len;
    if (n > room)
        n = room;
    if (n == 0)
        return;
    memcpy(b->data + b->len, chunk, n);
    b->len += n;
}

struct request {
    char *id, *marker, *workdir;
    double timeout;
    size_t cap;
    long stdin_len; /* -1: no stdin */
    char **argv, **env;
};

/* the header's fields: id, timeout, cap, marker, workdir, stdin length, argc, argv...,
 * envc, env... ; each one NUL-terminated. 0 on success. */
static int parse(char *body, size_t size, struct request *req, char **fields) {
    size_t n = 0, start = 0;
    if (size == 0 || body[size - 1] != '\0')
        return -1;
    for (size_t i = 0; i < size; i++) {
        if (body[i] == '\0') {
            if (n >= MAX_FIELDS)
                return -1;
            fields[n++] = body + start;
            start = i + 1;
        }
    }
    if (n < 8)
        return -1;
    char *end;
    req->id = fields[0];
    req->timeout = strtod(fields[1], &end);
    if (*end || !(req->timeout >= 0) || req->timeout > 1e9)
        return -1;
    unsigned long long cap = strtoull(fields[2], &end, 10);
    if (*end || cap > (1ULL << 40))
        return -1;
    req->cap = (size_t)cap;
    req->marker = fields[3];
    req->workdir = fields[4];
    if (fields[5][0] == '\0') {
        req->stdin_len = -1;
    } else {
        long long s = strtoll(fields[5], &end, 10);
        if (*end || s < 0 || s > MAX_STDIN)
            return -1;
        req->stdin_len = (long)s;
    }
    unsigned long argc = strtoul(fields[6], &end, 10);
    if (*end || argc > n - 8)
        return -1;
    req->argv = fields + 7;
    unsigned long envc = strtoul(fields[7 + argc], &end, 10);
    if (*end || 8 + argc + envc != n)
        return -1;
    /* argv and env each end where the next count (or the list's end) was: NULL them */
    fields[7 + argc] = NULL;
    req->env = fields + 8 + argc;
    req->env[envc] = NULL; /* fields has room: MAX_FIELDS + 1 */
    return 0;
}

static size_t key_len(const char *entry) {
    const char *eq = strchr(entry, '=');
    return eq ? (size_t)(eq - entry) : strlen(entry);
}

static int in_list(char **list, const char *entry) {
    size_t k = key_len(entry);
    for (; list && *list; list++)
        if (key_len(*list) == k && strncmp(*list, entry, k) == 0)
            return 1;
    return 0;
}

/* the runner's environment, then the request's over it, then the marker */
static char **merge_env(struct request *req) {
    size_t n = 0, m = 0;
    for (char **e = environ; e && *e; e++)
        n++;
    for (char **e = req->env; *e; e++)
        n++;
    char **out = calloc(n + 2, sizeof(char *));
    if (!out)
        return NULL;
    char *marker[] = {req->marker, NULL};
    for (char **e = environ; e && *e; e++)
        if (!in_list(req->env, *e) && !in_list(marker, *e))
            out[m++] = *e;
    for (char **e = req->env; *e; e++)
        if (!in_list(marker, *e))
            out[m++] = *e;
    out[m++] = req->marker;
    out[m] = NULL;
    return out;
}

/* as execvp finds a program, but only in absolute PATH directories (never one in the
 * sandbox-writable working directory); the path is written into `out` */
static int find_program(const char *name, char **env, char *out, size_t size) {
    if (strchr(name, '/')) {
        if (strlen(name) >= size)
            return -1;
        strcpy(out, name);
        return 0;
    }
    const char *path = "/bin:/usr/bin"; /* Python's os.defpath, as the other runner */
    for (char **e = env; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0)
            path = *e + 5; /* the last one wins, as a dict's update */
    const char *p = path;
    while (1) {
        const char *colon = strchr(p, ':');
        size_t len = colon ? (size_t)(colon - p) : strlen(p);
        if (len > 0 && p[0] == '/' && len + strlen(name) + 2 <= size) {
            memcpy(out, p, len);
            out[len] = '/';
            strcpy(out + len + 1, name);
            if (access(out, X_OK) == 0)
                return 0;
        }
        if (!colon)
            return -1;
        p = colon + 1;
    }
}

static void kill_marked(const char *marker) {
    DIR *proc = opendir("/proc");
    if (!proc)
        return;
    size_t mlen = strlen(marker);
    char *data = malloc(MAX_ENVIRON_READ);
    if (!data) {
        closedir(proc);
        return;
    }
    pid_t self = getpid();
    struct dirent *d;
    while ((d = readdir(proc))) {
        char *end;
        long pid = strtol(d->d_name, &end, 10);
        if (*end || pid <= 0 || pid == self)
            continue;
        char path[64];
        snprintf(path, sizeof path, "/proc/%ld/environ", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        size_t got = 0;
        while (got < MAX_ENVIRON_READ) {
            ssize_t r = read(fd, data + got, MAX_ENVIRON_READ - got);
            if (r <= 0)
                break;
            got += (size_t)r;
        }
        close(fd);
        for (size_t i = 0; i < got;) { /* NUL-separated entries: an exact one */
            size_t len = strnlen(data + i, got - i);
            if (len == mlen && memcmp(data + i, marker, mlen) == 0) {
                kill((pid_t)pid, SIGKILL);
                break;
            }
            i += len + 1;
        }
    }
    free(data);
    closedir(proc);
}

static int exit_code(int status) {
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return WEXITSTATUS(status);
}

/* the child's exit code, or -1 while it runs after `block_for` seconds */
static int wait_exit(pid_t pid, double block_for, int pidfd) {
    double end = now() + block_for;
    while (1) {
        int status;
        pid_t done = waitpid(pid, &status, WNOHANG);
        if (done == pid)
            return exit_code(status);
        if (done < 0 && errno != EINTR)
            return -2; /* not our child any more: nothing to wait for */
        double left = end - now();
        if (left <= 0)
            return -1;
        if (pidfd >= 0) {
            struct pollfd p = {pidfd, POLLIN, 0};
            poll(&p, 1, (int)(left * 1000) + 1);
        } else {
            usleep(1000);
        }
    }
}

static void signal_group(pid_t pid, int sig) {
    kill(-pid, sig);
}

struct result {
    int code, timed_out, spawn_failed;
    struct buf out, err;
};

static void fail(struct result *res, const char *what, int err) {
    char msg[512];
    int n = err ? snprintf(msg, sizeof msg, "cellgate-runner: %s: %s\n", what, strerror(err))
                : snprintf(msg, sizeof msg, "cellgate-runner: %s\n", what);
    if (n > (int)sizeof msg - 1)
        n = (int)sizeof msg - 1;
    keep(&res->err, msg, (size_t)n);
}

/* start the command: returns its pid, or -1 (nothing ran; `res` says why) */
static pid_t spawn(struct request *req, char **env, int *r_out, int *r_err, int *w_in,
                   struct result *res) {
    char program[4096];
    if (find_program(req->argv[0], env, program, sizeof program) < 0) {
        char what[600];
        snprintf(what, sizeof what, "%.500s is not on PATH", req->argv[0]);
        fail(res, what, 0);
        return -1;
    }
    int out[2] = {-1, -1}, err[2] = {-1, -1}, in[2] = {-1, -1}, report[2] = {-1, -1};
    int ok = pipe2(out, O_CLOEXEC) == 0 && pipe2(err, O_CLOEXEC) == 0 &&
             pipe2(report, O_CLOEXEC) == 0 &&
             (req->stdin_len >= 0 ? pipe2(in, O_CLOEXEC) == 0
                                  : (in[0] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0);
    if (!ok) {
        int e = errno;
        int all[] = {out[0], out[1], err[0], err[1], in[0], in[1], report[0], report[1]};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            if (all[i] >= 0)
                close(all[i]);
        fail(res, "pipe", e);
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        int e = 0;
        setsid();
        if (dup2(in[0], 0) < 0 || dup2(out[1], 1) < 0 || dup2(err[1], 2) < 0)
            e = errno;
        else if (req->workdir[0] && chdir(req->workdir) < 0)
            e = errno;
        if (!e) {
            signal(SIGPIPE, SIG_DFL);
            signal(SIGXFSZ, SIG_DFL);
            execve(program, req->argv, env);
            e = errno;
        }
        ssize_t ignored = write(report[1], &e, sizeof e);
        (void)ignored;
        _exit(127);
    }
    int e = pid < 0 ? errno : 0;
    close(report[1]);
    close(out[1]);
    close(err[1]);
    close(in[0]);
    if (pid > 0) {
        int child_err;
        ssize_t r;
        do
            r = read(report[0], &child_err, sizeof child_err);
        while (r < 0 && errno == EINTR);
        if (r == (ssize_t)sizeof child_err) { /* it never ran: reap it */
            waitpid(pid, NULL, 0);
            e = child_err;
            pid = -1;
        }
    }
    close(report[0]);
    if (pid < 0) {
        char what[600];
        snprintf(what, sizeof what, "cannot start %.500s", req->argv[0]);
        fail(res, what, e);
        close(out[0]);
        close(err[0]);
        if (in[1] >= 0)
            close(in[1]);
        return -1;
    }
    *r_out = out[0];
    *r_err = err[0];
    *w_in = in[1];
    return pid;
}

static void run(struct request *req, const char *stdin_data, struct result *res) {
    res->code = 126;
    if (!req->argv[0]) {
        fail(res, "bad request", 0);
        return;
    }
    char **env = merge_env(req);
    if (!env) {
        fail(res, "out of memory", 0);
        res->spawn_failed = 1;
        return;
    }
    int r_out = -1, r_err = -1, w_in = -1;
    pid_t pid = spawn(req, env, &r_out, &r_err, &w_in, res);
    free(env);
    if (pid < 0) {
        res->spawn_failed = 1;
        return;
    }
    size_t pending = req->stdin_len > 0 ? (size_t)req->stdin_len : 0;
    const char *in_at = stdin_data;
    if (w_in >= 0) {
        fcntl(w_in, F_SETFL, fcntl(w_in, F_GETFL) | O_NONBLOCK);
        if (!pending) {
            close(w_in);
            w_in = -1;
        }
    }
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    double started = now();
    double whole = req->timeout < 1 ? 1 : (double)(long long)req->timeout;
    if (whole < req->timeout)
        whole += 1; /* whole seconds, as `timeout` counts */
    double term_at = started + whole, kill_at = term_at + KILL_AFTER;
    double deadline = started + req->timeout + KILL_AFTER + GRACE;
    double exited_at = -1;
    int code = -1, deadline_hit = 0, signalled = 0, open_out = 1, open_err = 1;
    static char chunk[CHUNK];
    while (open_out || open_err || w_in >= 0) {
        double t = now();
        if (t >= deadline) {
            deadline_hit = 1;
            break;
        }
        if (code < 0) {
            code = wait_exit(pid, 0, -1);
            if (code == -2)
                code = -1;
            if (code >= 0)
                exited_at = t;
        }
        if (code < 0 && signalled != SIGKILL) {
            if (t >= kill_at) {
                signal_group(pid, SIGKILL);
                signalled = SIGKILL;
            } else if (t >= term_at && !signalled) {
                signal_group(pid, SIGTERM);
                signal_group(pid, SIGCONT); /* a stopped command gets it too */
                signalled = SIGTERM;
            }
        }
        if (exited_at >= 0 && t - exited_at > AFTER_EXIT)
            break; /* a background child holds the pipes: the command itself is done */
        double wake = (signalled ? kill_at : term_at);
        if (deadline < wake)
            wake = deadline;
        wake -= t;
        if (wake < 0)
            wake = 0;
        if (wake > 0.05)
            wake = 0.05;
        struct pollfd fds[4];
        int n = 0;
        if (open_out)
            fds[n++] = (struct pollfd){r_out, POLLIN, 0};
        if (open_err)
            fds[n++] = (struct pollfd){r_err, POLLIN, 0};
        if (w_in >= 0)
            fds[n++] = (struct pollfd){w_in, POLLOUT, 0};
        if (pidfd >= 0 && code < 0)
            fds[n++] = (struct pollfd){pidfd, POLLIN, 0};
        if (poll(fds, (nfds_t)n, (int)(wake * 1000) + 1) <= 0)
            continue;
        for (int i = 0; i < n; i++) {
            if (!fds[i].revents)
                continue;
            int fd = fds[i].fd;
            if (fd == pidfd)
                continue; /* it exited: the next round reaps it */
            if (fd == w_in) {
                size_t len = pending < CHUNK ? pending : CHUNK;
                ssize_t sent = write(fd, in_at, len);
                if (sent < 0 && (errno == EAGAIN || errno == EINTR))
                    continue;
                if (sent < 0)
                    sent = (ssize_t)pending; /* it closed its stdin: the rest is dropped */
                in_at += sent;
                pending -= (size_t)sent;
                if (!pending) {
                    close(w_in);
                    w_in = -1;
                }
                continue;
            }
            ssize_t r = read(fd, chunk, sizeof chunk);
            if (r < 0 && (errno == EAGAIN || errno == EINTR))
                continue;
            if (r <= 0) {
                if (fd == r_out)
                    open_out = 0;
                else
                    open_err = 0;
                continue;
            }
            keep(fd == r_out ? &res->out : &res->err, chunk, (size_t)r);
        }
    }
    while (code < 0 && !deadline_hit) { /* its output closed, it runs on: the clock too */
        double t = now();
        if (t >= deadline) {
            deadline_hit = 1;
            break;
        }
        if (t >= kill_at) {
            if (signalled != SIGKILL) {
                signal_group(pid, SIGKILL);
                signalled = SIGKILL;
            }
        } else if (t >= term_at && !signalled) {
            signal_group(pid, SIGTERM);
            signal_group(pid, SIGCONT);
            signalled = SIGTERM;
        }
        double wake = (signalled == SIGKILL ? deadline : signalled ? kill_at : term_at) - t;
        code = wait_exit(pid, wake > 0.001 ? wake : 0.001, pidfd);
        if (code == -2) { /* not our child any more: nothing to wait for */
            code = -1;
            break;
        }
    }
    if (deadline_hit) {
        kill(-pid, SIGKILL);
        kill_marked(req->marker);
    }
    if (code < 0)
        code = wait_exit(pid, GRACE, pidfd);
    if (code < 0)
        code = -1;
    if (pidfd >= 0)
        close(pidfd);
    if (signalled && !deadline_hit)
        code = signalled == SIGKILL ? 137 : 124; /* as `timeout` exits */
    res->timed_out = deadline_hit || signalled;
    if (res->timed_out && !deadline_hit)
        kill_marked(req->marker);
    close(r_out);
    close(r_err);
    if (w_in >= 0)
        close(w_in);
    res->code = deadline_hit ? -1 : code;
}

/* the reply's JSON: ints, booleans and the request's id (its letters and digits) */
static int reply(int sock, struct request *req, struct result *res) {
    char id[64];
    size_t n = 0;
    for (const char *c = req->id; *c && n < sizeof id - 1; c++)
        if ((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z'))
            id[n++] = *c;
    id[n] = '\0';
    char head[512];
    int len;
    if (res->spawn_failed)
        len = snprintf(head, sizeof head,
                       "{\"spawn_failed\": true, \"code\": 126, \"out_len\": %zu, "
                       "\"err_len\": %zu, \"id\": \"%s\"}",
                       res->out.len, res->err.len, id);
    else
        len = snprintf(head, sizeof head,
                       "{\"code\": %d, \"timed_out\": %s, \"out_len\": %zu, \"err_len\": %zu, "
                       "\"id\": \"%s\"}",
                       res->code, res->timed_out ? "true" : "false", res->out.len,
                       res->err.len, id);
    unsigned char size[4] = {(unsigned char)(len >> 24), (unsigned char)(len >> 16),
                             (unsigned char)(len >> 8), (unsigned char)len};
    if (write_all(sock, (char *)size, 4) < 0 || write_all(sock, head, (size_t)len) < 0 ||
        write_all(sock, res->out.data, res->out.len) < 0 ||
        write_all(sock, res->err.data, res->err.len) < 0)
        return -1;
    return 0;
}

static int serve(int sock) {
    static char *fields[MAX_FIELDS + 1];
    while (1) {
        unsigned char raw[4];
        if (read_exact(sock, (char *)raw, 4) < 0)
            return 0;
        size_t size = ((size_t)raw[0] << 24) | ((size_t)raw[1] << 16) | ((size_t)raw[2] << 8) | raw[3];
        if (size > MAX_HEADER)
            return 1;
        char *body = malloc(size + 1);
        if (!body || read_exact(sock, body, size) < 0)
            return 1;
        struct request req;
        if (parse(body, size, &req, fields) < 0)
            return 1;
        char *stdin_data = NULL;
        if (req.stdin_len >= 0) {
            stdin_data = malloc((size_t)req.stdin_len + 1);
            if (!stdin_data || read_exact(sock, stdin_data, (size_t)req.stdin_len) < 0)
                return 1;
        }
        struct result res = {0};
        res.out.cap = res.err.cap = req.cap;
        res.out.data = malloc(req.cap + 1);
        res.err.data = malloc(req.cap + 1);
        if (!res.out.data || !res.err.data)
            return 1;
        res.err.cap = req.cap;
        run(&req, stdin_data, &res);
        int sent = reply(sock, &req, &res);
        free(res.out.data);
        free(res.err.data);
        free(stdin_data);
        free(body);
        if (sent < 0)
            return 1;
    }
}

int main(int argc, char **argv) {
    /* descriptors 0-2 open (to /dev/null when the runner got them closed): a pipe made
     * later must never be one of them */
    int null;
    do
        null = open("/dev/null", O_RDWR);
    while (null >= 0 && null <= 2);
    if (null > 2)
        close(null);
    /* what the waiting shell opened (this very binary, the slot's init) is not the
     * commands' to inherit */
    if (syscall(SYS_close_range, 3, ~0U, 0) < 0)
        for (int fd = 3; fd < 1024; fd++)
            close(fd);
    signal(SIGPIPE, SIG_IGN); /* a command that leaves its stdin unread, or a gateway
                                 gone, is an EPIPE here, never the end of the runner */
    signal(SIGXFSZ, SIG_IGN);
    /* named in `ps` and /proc/<pid>/comm as the Python one is (a pooled sandbox runs
     * it from a descriptor: `/proc/self/fd/3 cellgate-runner`) */
    prctl(PR_SET_NAME, "cellgate-runner", 0, 0, 0);
    const char *path = SOCKET; /* or the last argument that is a path */
    for (int i = 1; i < argc; i++)
        if (argv[i][0] == '/')
            path = argv[i];
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return 1;
    strcpy(addr.sun_path, path);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return 1;
    double deadline = now() + CONNECT_WAIT;
    while (connect(sock, (struct sockaddr *)&addr, sizeof addr) < 0) {
        /* not yet bound, not yet listening, or bound but not yet opened to us */
        if (errno != ENOENT && errno != ECONNREFUSED && errno != EACCES && errno != EPERM &&
            errno != EINTR)
            return 1;
        if (now() > deadline)
            return 1;
        usleep(2000);
    }
    return serve(sock);
}
