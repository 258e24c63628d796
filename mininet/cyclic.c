/*
 * cyclic: a cyclic UDP stream with a send and a receive stamp on every frame, for the
 * `jitter` experiment (mininet/experiments.py), after Wüsteney et al., "Impact of Packet
 * Filtering on Time-Sensitive Networking Traffic".
 *
 *   cyclic send --dst ADDR --port P --cycle-us C --count N [--size BYTES] [--sport S] [--rt]
 *   cyclic recv --port P --out FILE [--rt]
 *
 * The hosts are network namespaces of one kernel, so both ends read the same clock.
 *
 * send: frame k leaves at t0 + k * cycle (CLOCK_MONOTONIC, clock_nanosleep TIMER_ABSTIME,
 *   an absolute schedule: a late wake-up sends at once and does not shift later frames).
 *   Each payload carries the sequence number and a CLOCK_REALTIME stamp taken just before
 *   sendto(). --size is the Ethernet frame (header 14 + IPv4 20 + UDP 8 + payload).
 *   Prints "ready" once the socket is up, and at the end one line of key=value: frames
 *   sent, how late the wake-ups were (the source's own jitter) and the clock's resolution.
 * recv: SO_TIMESTAMPNS gives the kernel's receive stamp (CLOCK_REALTIME, taken when the
 *   frame entered the receiver's network stack, before the socket queue and the wake-up);
 *   a user-space stamp is taken after recvmsg() too. Each frame is written to FILE as four
 *   little-endian u64: seq, send stamp, kernel receive stamp, user receive stamp (ns).
 *   The first frame from a sender is answered with one datagram: a stream with a reply is
 *   ESTABLISHED to conntrack, which is what the shunt policy matches. Prints "ready" once
 *   bound; SIGTERM/SIGINT flush FILE and exit.
 *
 * --rt: SCHED_FIFO priority 50 (what a control application would run at); if refused, the
 *   program says so on stderr and runs at normal priority.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define HEADERS (14 + 20 + 8)
#define MAX_FRAME 1514

struct stamp { uint64_t seq, tx_ns; };   /* the payload's head */
struct record { uint64_t seq, tx_ns, rx_kernel_ns, rx_user_ns; };

static volatile sig_atomic_t stop;

static void on_signal(int sig) { (void)sig; stop = 1; }

static uint64_t ns_of(const struct timespec *ts)
{
    return (uint64_t)ts->tv_sec * 1000000000ull + (uint64_t)ts->tv_nsec;
}

static uint64_t now_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ns_of(&ts);
}

static void realtime_priority(void)
{
    struct sched_param sp = { .sched_priority = 50 };
    if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0)
        fprintf(stderr, "cyclic: SCHED_FIFO refused (%s); normal priority\n", strerror(errno));
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int do_send(const char *dst, int port, long cycle_us, long count, int size, int sport)
{
    if (size < HEADERS + (int)sizeof(struct stamp) || size > MAX_FRAME) {
        fprintf(stderr, "cyclic: --size must be %d..%d bytes\n", HEADERS + (int)sizeof(struct stamp), MAX_FRAME);
        return 2;
    }
    struct sockaddr_in to = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    if (inet_pton(AF_INET, dst, &to.sin_addr) != 1) {
        fprintf(stderr, "cyclic: --dst %s is not an IPv4 address\n", dst);
        return 2;
    }
    /* --sport: the stream's own source port (the experiment gives each cell one: a stream on
     * the tuple of an earlier cell would find that cell's shunt still on the switch). */
    struct sockaddr_in me = { .sin_family = AF_INET, .sin_port = htons((uint16_t)sport),
                              .sin_addr.s_addr = htonl(INADDR_ANY) };
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0 || (sport && bind(fd, (struct sockaddr *)&me, sizeof me) != 0)
        || connect(fd, (struct sockaddr *)&to, sizeof to) != 0) {
        perror("cyclic: socket");
        return 1;
    }
    socklen_t melen = sizeof me;
    getsockname(fd, (struct sockaddr *)&me, &melen);
    uint64_t *late = calloc((size_t)count, sizeof *late);   /* wake-up lateness per frame */
    if (!late) {
        perror("cyclic: calloc");
        return 1;
    }
    char buf[MAX_FRAME] = {0};
    size_t payload = (size_t)(size - HEADERS);
    uint64_t cycle_ns = (uint64_t)cycle_us * 1000u;
    struct timespec res;
    clock_getres(CLOCK_REALTIME, &res);
    printf("ready\n");
    fflush(stdout);
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t t0 = ns_of(&t) + 10 * cycle_ns;
    long sent = 0, errors = 0;
    for (long k = 0; k < count && !stop; k++) {
        uint64_t due = t0 + (uint64_t)k * cycle_ns;
        struct timespec ts = { .tv_sec = (time_t)(due / 1000000000ull), .tv_nsec = (long)(due % 1000000000ull) };
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR && !stop)
            ;
        uint64_t woke = now_ns(CLOCK_MONOTONIC);
        late[k] = woke > due ? woke - due : 0;
        struct stamp s = { (uint64_t)k, now_ns(CLOCK_REALTIME) };
        memcpy(buf, &s, sizeof s);
        if (send(fd, buf, payload, 0) == (ssize_t)payload)
            sent++;
        else
            errors++;
    }
    long n = sent + errors;
    qsort(late, (size_t)n, sizeof *late, cmp_u64);
    long over = 0;
    for (long k = 0; k < n; k++)
        over += late[k] > cycle_ns;
    printf("sent=%ld errors=%ld wake_late_median_ns=%llu wake_late_p999_ns=%llu wake_late_max_ns=%llu "
           "wake_late_over_cycle=%ld clock_res_ns=%ld sport=%d\n", sent, errors,
           n ? (unsigned long long)late[n / 2] : 0ull,
           n ? (unsigned long long)late[n - 1 - n / 1000] : 0ull,
           n ? (unsigned long long)late[n - 1] : 0ull, over, res.tv_nsec + res.tv_sec * 1000000000L,
           ntohs(me.sin_port));
    free(late);
    close(fd);
    return errors ? 1 : 0;
}

static int do_recv(int port, const char *out)
{
    FILE *fh = fopen(out, "wb");
    if (!fh) {
        perror("cyclic: --out");
        return 1;
    }
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    int on = 1;
    int rcvbuf = 4 << 20;
    struct sockaddr_in me = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                              .sin_addr.s_addr = htonl(INADDR_ANY) };
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on) != 0
        || setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf) != 0
        || bind(fd, (struct sockaddr *)&me, sizeof me) != 0) {
        perror("cyclic: socket");
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    char buf[MAX_FRAME];
    char ctrl[CMSG_SPACE(sizeof(struct timespec))];
    struct sockaddr_in peer, answered = {0};
    long frames = 0, unstamped = 0;
    while (!stop) {
        struct iovec iov = { buf, sizeof buf };
        struct msghdr msg = { .msg_name = &peer, .msg_namelen = sizeof peer, .msg_iov = &iov, .msg_iovlen = 1,
                              .msg_control = ctrl, .msg_controllen = sizeof ctrl };
        ssize_t n = recvmsg(fd, &msg, 0);
        uint64_t user = now_ns(CLOCK_REALTIME);
        if (n < (ssize_t)sizeof(struct stamp))
            continue;   /* EINTR (a stop signal) or a stray short datagram */
        struct record r = { .rx_user_ns = user };
        struct stamp s;
        memcpy(&s, buf, sizeof s);
        r.seq = s.seq;
        r.tx_ns = s.tx_ns;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                struct timespec ts;
                memcpy(&ts, CMSG_DATA(c), sizeof ts);
                r.rx_kernel_ns = ns_of(&ts);
            }
        unstamped += r.rx_kernel_ns == 0;
        fwrite(&r, sizeof r, 1, fh);
        frames++;
        if (peer.sin_port != answered.sin_port || peer.sin_addr.s_addr != answered.sin_addr.s_addr) {
            sendto(fd, "ack", 3, 0, (struct sockaddr *)&peer, sizeof peer);
            answered = peer;
        }
    }
    fclose(fh);
    printf("frames=%ld unstamped=%ld\n", frames, unstamped);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "send") && strcmp(argv[1], "recv"))) {
        fprintf(stderr, "usage: cyclic send --dst ADDR --port P --cycle-us C --count N [--size B] [--sport S] [--rt]\n"
                        "       cyclic recv --port P --out FILE [--rt]\n");
        return 2;
    }
    static const struct option opts[] = {
        {"dst", required_argument, 0, 'd'}, {"port", required_argument, 0, 'p'},
        {"cycle-us", required_argument, 0, 'c'}, {"count", required_argument, 0, 'n'},
        {"size", required_argument, 0, 's'}, {"out", required_argument, 0, 'o'},
        {"sport", required_argument, 0, 'S'}, {"rt", no_argument, 0, 'r'}, {0, 0, 0, 0}};
    const char *dst = NULL, *out = NULL;
    int port = 0, size = 512, rt = 0, sport = 0, opt;
    long cycle_us = 0, count = 0;
    optind = 2;
    while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (opt) {
        case 'd': dst = optarg; break;
        case 'p': port = atoi(optarg); break;
        case 'c': cycle_us = atol(optarg); break;
        case 'n': count = atol(optarg); break;
        case 's': size = atoi(optarg); break;
        case 'o': out = optarg; break;
        case 'S': sport = atoi(optarg); break;
        case 'r': rt = 1; break;
        default: return 2;
        }
    }
    if (port <= 0 || port > 65535) {
        fprintf(stderr, "cyclic: --port must be 1..65535\n");
        return 2;
    }
    struct sigaction sa = { .sa_handler = on_signal };   /* no SA_RESTART: recvmsg returns on a stop */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (rt)
        realtime_priority();
    if (argv[1][0] == 's') {
        if (!dst || cycle_us < 10 || count < 1) {
            fprintf(stderr, "cyclic: send needs --dst, --cycle-us >= 10 and --count >= 1\n");
            return 2;
        }
        if (sport < 0 || sport > 65535) {
            fprintf(stderr, "cyclic: --sport must be 1..65535\n");
            return 2;
        }
        return do_send(dst, port, cycle_us, count, size, sport);
    }
    if (!out) {
        fprintf(stderr, "cyclic: recv needs --out\n");
        return 2;
    }
    return do_recv(port, out);
}
