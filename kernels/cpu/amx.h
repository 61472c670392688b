/* AMX tile configuration (Intel AMX-TILE: `ldtilecfg`'s 64-byte operand), shared by the GEMVs' AMX tiles
 * (gemv_bf16.c, gemv_int4.c). Palette 1: up to 8 tiles of at most 16 rows by 64 bytes. */
#ifndef EDGESERVE_AMX_H
#define EDGESERVE_AMX_H

#include <stdint.h>

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile t */
    uint8_t rows[16];   /* rows of tile t */
} TileConfig;

#endif
