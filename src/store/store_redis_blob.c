/* The values of the Redis tier: sealing, checking and naming them, and the
 * shared secret file that may key their checksums. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/store_internal.h"

enum { SECRET_MIN_BYTES = 16, SECRET_MAX_BYTES = 4096 };

struct store_header store_blob_header(const uint8_t fingerprint[16], struct store_key key, struct store_key parent,
                                      uint32_t n_tokens, size_t payload_len, bool keyed)
{
    struct store_header h = {.magic = STORE_MAGIC, .version = STORE_VERSION, .key = key, .parent = parent,
                             .n_tokens = n_tokens, .reserved = keyed ? STORE_BLOB_KEYED : 0,
                             .payload_len = payload_len};
    memcpy(h.fingerprint, fingerprint, sizeof h.fingerprint);
    return h;
}

uint64_t store_blob_checksum(const struct store_header *h, const void *payload, const uint8_t *secret)
{
    struct store_header z = *h;
    z.checksum = 0;
    XXH3_state_t st;
    if (secret)
        XXH3_64bits_reset_withSecret(&st, secret, XXH3_SECRET_DEFAULT_SIZE);
    else
        XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, &z, sizeof z);
    XXH3_64bits_update(&st, payload, (size_t)h->payload_len);
    return XXH3_64bits_digest(&st);
}

enum store_blob_verdict store_blob_check(const void *data, size_t len, const uint8_t fingerprint[16],
                                         struct store_key key, const uint8_t *secret)
{
    struct store_header h;
    if (!data || len < sizeof h)
        return STORE_BLOB_CORRUPT;
    memcpy(&h, data, sizeof h);
    if (h.magic != STORE_MAGIC)
        return STORE_BLOB_CORRUPT;
    if (h.version != STORE_VERSION || memcmp(h.fingerprint, fingerprint, sizeof h.fingerprint) ||
        h.key.lo != key.lo || h.key.hi != key.hi || h.reserved != (secret ? (uint32_t)STORE_BLOB_KEYED : 0u))
        return STORE_BLOB_FOREIGN;
    if (h.payload_len != len - sizeof h)
        return STORE_BLOB_CORRUPT;
    return store_blob_checksum(&h, (const uint8_t *)data + sizeof h, secret) == h.checksum ? STORE_BLOB_OK
                                                                                            : STORE_BLOB_CORRUPT;
}

static void put_hex(char *out, const uint8_t *bytes, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
}

static void put_hex64(char *out, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (56 - 8 * i));
    put_hex(out, b, sizeof b);
}

void store_redis_key_name(const uint8_t fingerprint[16], struct store_key key, char out[STORE_REDIS_KEY_CHARS + 1])
{
    memcpy(out, "kvserve:", 8);
    put_hex(out + 8, fingerprint, 16);
    out[40] = ':';
    put_hex64(out + 41, key.hi);
    put_hex64(out + 57, key.lo);
    out[STORE_REDIS_KEY_CHARS] = '\0';
}

ks_status store_blob_load_secret(const char *path, uint8_t secret[XXH3_SECRET_DEFAULT_SIZE])
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return ks_fail(KS_ERR_IO, "--cache-redis-secret-file %s: %s", path, strerror(errno));
    struct stat sb;
    uint8_t key[SECRET_MAX_BYTES];
    ssize_t n = -1;
    ks_status st = KS_OK;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_uid != geteuid() || (sb.st_mode & 077))
        st = ks_fail(KS_ERR_IO, "--cache-redis-secret-file %s must be a regular file of this server's user that "
                     "nobody else can read (it keys the checksums of the shared pages); chmod 600 %s", path, path);
    else if (sb.st_size < SECRET_MIN_BYTES || sb.st_size > SECRET_MAX_BYTES ||
             (n = pread(fd, key, (size_t)sb.st_size, 0)) != sb.st_size)
        st = ks_fail(KS_ERR_IO, "--cache-redis-secret-file %s must hold %d to %d bytes (e.g. head -c 32 "
                     "/dev/urandom > %s), the same file on every replica", path, SECRET_MIN_BYTES, SECRET_MAX_BYTES,
                     path);
    close(fd);
    if (!st && XXH3_generateSecret(secret, XXH3_SECRET_DEFAULT_SIZE, key, (size_t)n) != XXH_OK)
        st = ks_fail(KS_ERR_IO, "--cache-redis-secret-file %s: cannot derive the checksum secret", path);
    memset(key, 0, sizeof key);
    return st;
}
