/*
 * nfqdelay: hold every packet of an NFQUEUE queue for a fixed time, then accept it.
 *
 * The testbed's delay emulation where the kernel has no netem. iptables sends a host's
 * packets to queue N; this program asks for metadata only (no payload copy), stamps each
 * packet on arrival and, once the oldest packets are due, accepts them with one batch
 * verdict. A constant delay keeps the queue in FIFO order, so "accept every id up to X" is
 * exact and costs one message per batch instead of one per packet.
 *
 *   nfqdelay --queue N --delay-ms D [--maxlen PACKETS]
 *
 * Prints "ready" once bound. SIGTERM/SIGINT accept whatever is still held and exit.
 * Packets beyond --maxlen are dropped by the kernel, like a full netem queue; the drop
 * count is in /proc/net/netfilter/nfnetlink_queue of the namespace.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <arpa/inet.h>
#include <getopt.h>
#include <linux/netfilter.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RING (1u << 18) /* power of two, larger than any --maxlen we accept */

struct held { uint32_t id; uint64_t due_ns; };

static struct held ring[RING];
static uint32_t head, tail; /* held packets are ring[tail..head) */
static uint64_t delay_ns;
static volatile sig_atomic_t stop;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data)
{
    (void)msg; (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph)
        return 0;
    uint32_t id = ntohl(ph->packet_id);
    if (head - tail >= RING) /* cannot happen with maxlen < RING; never block the kernel */
        return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
    ring[head % RING] = (struct held){ id, now_ns() + delay_ns };
    head++;
    return 0;
}

/* Accept every packet that is due; return ns until the next one is (or -1 if none held). */
static int64_t release(struct nfq_q_handle *qh, int all)
{
    uint64_t now = now_ns();
    uint32_t last = tail;
    while (last != head && (all || ring[last % RING].due_ns <= now))
        last++;
    if (last != tail) {
        nfq_set_verdict_batch(qh, ring[(last - 1) % RING].id, NF_ACCEPT);
        tail = last;
    }
    if (tail == head)
        return -1;
    return (int64_t)(ring[tail % RING].due_ns - now);
}

static void on_signal(int sig) { (void)sig; stop = 1; }

static void usage(void)
{
    fprintf(stderr, "usage: nfqdelay --queue N --delay-ms D [--maxlen PACKETS]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    long queue = -1, maxlen = 100000;
    double delay_ms = -1;
    static const struct option opts[] = {
        {"queue", required_argument, 0, 'q'},
        {"delay-ms", required_argument, 0, 'd'},
        {"maxlen", required_argument, 0, 'm'},
        {0, 0, 0, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "q:d:m:", opts, NULL)) != -1) {
        char *end = NULL;
        switch (c) {
        case 'q': queue = strtol(optarg, &end, 10); break;
        case 'd': delay_ms = strtod(optarg, &end); break;
        case 'm': maxlen = strtol(optarg, &end, 10); break;
        default: usage();
        }
        if (!end || *end)
            usage();
    }
    if (queue < 0 || queue > 65535 || delay_ms < 0 || delay_ms > 10000 || maxlen < 1 || maxlen >= (long)RING)
        usage();
    delay_ns = (uint64_t)(delay_ms * 1e6);

    struct nfq_handle *h = nfq_open();
    if (!h) { perror("nfqdelay: nfq_open"); return 1; }
    struct nfq_q_handle *qh = nfq_create_queue(h, (uint16_t)queue, on_packet, NULL);
    if (!qh) { perror("nfqdelay: nfq_create_queue (is another program bound to this queue?)"); return 1; }
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) { perror("nfqdelay: nfq_set_mode"); return 1; }
    if (nfq_set_queue_maxlen(qh, (uint32_t)maxlen) < 0) { perror("nfqdelay: nfq_set_queue_maxlen"); return 1; }
    int fd = nfq_fd(h);
    int rcvbuf = 64 << 20;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf) < 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    int one = 1; /* a burst that overflows the socket must not stop us: the kernel drops */
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);

    struct sigaction sa = { .sa_handler = on_signal };
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("ready queue=%ld delay_ms=%g maxlen=%ld\n", queue, delay_ms, maxlen);
    fflush(stdout);

    static char buf[1 << 16];
    struct pollfd pfd = { .fd = fd, .events = POLLIN };
    while (!stop) {
        int64_t wait_ns = release(qh, 0);
        struct timespec ts, *tsp = NULL;
        if (wait_ns >= 0) {
            ts.tv_sec = wait_ns / 1000000000;
            ts.tv_nsec = wait_ns % 1000000000;
            tsp = &ts;
        }
        int n = ppoll(&pfd, 1, tsp, NULL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            perror("nfqdelay: ppoll");
            break;
        }
        if (n == 0)
            continue;
        /* Drain everything queued on the socket before computing the next deadline. */
        for (;;) {
            ssize_t len = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (len < 0) {
                if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ENOBUFS)
                    perror("nfqdelay: recv");
                break;
            }
            nfq_handle_packet(h, buf, (int)len);
        }
    }
    release(qh, 1);
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}
