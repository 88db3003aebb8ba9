// Tests of the PNG writer (src/io/png.cpp): checksums against published check values, and a decode
// of the written file by an independent parser here (signature, chunk CRCs, IHDR fields, STORED
// deflate blocks, Adler-32, filter bytes) that must give back the exact pixels. Plus the drawing
// primitives (text, heat map, polyline) put colour where expected.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/rng.h"
#include "io/png.h"
#include "moekit/error.h"

namespace moekit::io {
namespace {

uint32_t be32(const uint8_t* p) { return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3]; }

// Bit-at-a-time CRC-32 (no table), independent of the writer's table-driven one.
uint32_t slow_crc32(const uint8_t* data, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; ++i) {
        c ^= data[i];
        for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
    }
    return ~c;
}

struct Decoded {
    uint32_t width = 0, height = 0;
    uint8_t bit_depth = 0, colour_type = 0, compression = 0, filter = 0, interlace = 0;
    std::vector<uint8_t> pixels;
    int num_stored_blocks = 0;
};

// Inflates a zlib stream made only of STORED blocks; fails the test on anything else.
std::vector<uint8_t> inflate_stored(const std::vector<uint8_t>& z, int* num_blocks) {
    std::vector<uint8_t> out;
    EXPECT_GE(z.size(), 6u);
    EXPECT_EQ((z[0] * 256 + z[1]) % 31, 0) << "zlib FCHECK";
    EXPECT_EQ(z[0] & 0x0f, 8) << "zlib CM must be deflate";
    EXPECT_EQ(z[1] & 0x20, 0) << "no preset dictionary";
    size_t pos = 2;
    bool final_block = false;
    *num_blocks = 0;
    while (!final_block) {
        if (pos + 5 > z.size()) {
            ADD_FAILURE() << "truncated block header at " << pos;
            return out;
        }
        const uint8_t header = z[pos];
        final_block = header & 1;
        EXPECT_EQ((header >> 1) & 3, 0) << "BTYPE must be STORED";
        const uint16_t len = uint16_t(z[pos + 1] | (z[pos + 2] << 8));
        const uint16_t nlen = uint16_t(z[pos + 3] | (z[pos + 4] << 8));
        EXPECT_EQ(uint16_t(~len), nlen) << "LEN/NLEN mismatch in block " << *num_blocks;
        pos += 5;
        if (pos + len > z.size()) {
            ADD_FAILURE() << "truncated block data";
            return out;
        }
        out.insert(out.end(), z.begin() + long(pos), z.begin() + long(pos + len));
        pos += len;
        ++*num_blocks;
    }
    EXPECT_EQ(pos + 4, z.size()) << "trailing bytes after the Adler-32";
    EXPECT_EQ(be32(&z[pos]), adler32(out.data(), out.size()));
    return out;
}

Decoded decode(const std::vector<uint8_t>& png) {
    Decoded d;
    const uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};
    EXPECT_EQ(std::memcmp(png.data(), kSignature, 8), 0) << "PNG signature";
    std::vector<std::string> order;
    std::vector<uint8_t> idat;
    size_t pos = 8;
    while (pos + 12 <= png.size()) {
        const uint32_t len = be32(&png[pos]);
        const std::string type(reinterpret_cast<const char*>(&png[pos + 4]), 4);
        EXPECT_LE(pos + 12 + len, png.size()) << "chunk " << type << " overruns the file";
        EXPECT_EQ(be32(&png[pos + 8 + len]), slow_crc32(&png[pos + 4], 4 + len)) << "CRC of chunk " << type;
        const uint8_t* data = &png[pos + 8];
        order.push_back(type);
        if (type == "IHDR") {
            EXPECT_EQ(len, 13u);
            d.width = be32(data);
            d.height = be32(data + 4);
            d.bit_depth = data[8], d.colour_type = data[9], d.compression = data[10];
            d.filter = data[11], d.interlace = data[12];
        } else if (type == "IDAT") {
            idat.insert(idat.end(), data, data + len);
        }
        pos += 12 + len;
    }
    EXPECT_EQ(pos, png.size());
    EXPECT_EQ(order.front(), "IHDR");
    EXPECT_EQ(order.back(), "IEND");
    const std::vector<uint8_t> raw = inflate_stored(idat, &d.num_stored_blocks);
    const size_t row = size_t(d.width) * 3;
    EXPECT_EQ(raw.size(), (row + 1) * d.height);
    if (raw.size() != (row + 1) * d.height) return d;
    for (uint32_t y = 0; y < d.height; ++y) {
        EXPECT_EQ(raw[y * (row + 1)], 0) << "filter byte of row " << y;
        d.pixels.insert(d.pixels.end(), raw.begin() + long(y * (row + 1) + 1), raw.begin() + long((y + 1) * (row + 1)));
    }
    return d;
}

TEST(Png, ChecksumsMatchPublishedCheckValues) {
    const std::string s = "123456789";
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    EXPECT_EQ(crc32(p, s.size()), 0xCBF43926u);  // the CRC-32/ISO-HDLC check value
    EXPECT_EQ(crc32(p + 4, 5, crc32(p, 4)), 0xCBF43926u) << "running CRC must continue a stream";
    const std::string w = "Wikipedia";
    EXPECT_EQ(adler32(reinterpret_cast<const uint8_t*>(w.data()), w.size()), 0x11E60398u);  // RFC 1950 example
    EXPECT_EQ(adler32(nullptr, 0), 1u);
}

TEST(Png, AdlerModulusIsApplied) {
    // 70000 bytes of 0xff push both sums far past 65521: a missing modulus would show.
    std::vector<uint8_t> ff(70000, 0xff);
    uint64_t a = 1, b = 0;
    for (uint8_t x : ff) a = (a + x) % 65521, b = (b + a) % 65521;
    EXPECT_EQ(adler32(ff.data(), ff.size()), uint32_t((b << 16) | a));
}

// Sizes: a tiny image, one with a raw stream of exactly 65535 bytes, and one spanning several blocks.
class PngRoundTrip : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(PngRoundTrip, DecodesToTheExactPixels) {
    const auto [w, h] = GetParam();
    constexpr uint64_t kSeed = 20240611;
    Image img(w, h);
    Rng rng(kSeed, uint64_t(w * 1000 + h));
    for (auto& v : img.pixels) v = uint8_t(rng.below(256));
    const std::vector<uint8_t> png = encode_png(img);
    const Decoded d = decode(png);
    EXPECT_EQ(d.width, uint32_t(w));
    EXPECT_EQ(d.height, uint32_t(h));
    EXPECT_EQ(d.bit_depth, 8);
    EXPECT_EQ(d.colour_type, 2);
    EXPECT_EQ(d.compression, 0);
    EXPECT_EQ(d.filter, 0);
    EXPECT_EQ(d.interlace, 0);
    const size_t raw_bytes = size_t(w * 3 + 1) * size_t(h);
    EXPECT_EQ(d.num_stored_blocks, int((raw_bytes + 65534) / 65535));
    ASSERT_EQ(d.pixels.size(), img.pixels.size());
    EXPECT_TRUE(d.pixels == img.pixels) << "seed " << kSeed << ", " << w << "x" << h;
}

INSTANTIATE_TEST_SUITE_P(Sizes, PngRoundTrip,
                         ::testing::Values(std::pair{1, 1}, std::pair{3, 2}, std::pair{1456, 15},  // 65535 raw bytes
                                           std::pair{1456, 16}, std::pair{300, 200}));

TEST(Png, WritesFileAndRefusesBadPath) {
    Image img(4, 3, {10, 20, 30});
    const std::string path = (std::filesystem::temp_directory_path() / "moekit_test_png.png").string();
    write_png(path, img);
    std::ifstream f(path, std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(bytes, encode_png(img));
    std::filesystem::remove(path);
    EXPECT_THROW(write_png("/nonexistent-dir/x.png", img), UsageError);
}

TEST(Draw, TextAndShapesPutColourWhereExpected) {
    Image img(60, 20);
    const Rgb red{255, 0, 0};
    draw_text(img, 1, 1, "1", red);
    // '1' = rows 0x04,0x0C,0x04,...: column 2 is set in every row, column 0 in none.
    for (int row = 0; row < kGlyphHeight; ++row) {
        EXPECT_EQ(img.get(1 + 2, 1 + row).r, 255);
        EXPECT_EQ(img.get(1 + 0, 1 + row).g, 255) << "column 0 of '1' must stay white";
    }
    EXPECT_EQ(text_width("ab", 1), 11);
    EXPECT_EQ(text_width("ab", 2), 22);
    draw_line(img, 0, 15, 59, 15, {0, 0, 255});
    for (int x = 0; x < 60; ++x) EXPECT_EQ(img.get(x, 15).b, 255);
    EXPECT_NO_THROW(draw_line(img, -10, -10, 100, 100, red, 3));  // clipped, no out-of-bounds write
}

TEST(Draw, HeatmapUsesColormapEnds) {
    Image img(10, 10);
    draw_heatmap(img, 0, 0, 9, 9, {{0.0, 1.0}, {1.0, 0.0}}, 0.0, 1.0);
    const Rgb lo = colormap(0), hi = colormap(1);
    EXPECT_EQ(img.get(0, 0).r, lo.r);
    EXPECT_EQ(img.get(9, 0).g, hi.g);
    EXPECT_EQ(img.get(0, 9).g, hi.g);
    EXPECT_EQ(img.get(9, 9).b, lo.b);
    EXPECT_NE(lo.b, hi.b);
}

TEST(Draw, NiceTicksCoverRange) {
    const auto t = nice_ticks(0, 4.2, 5);
    ASSERT_FALSE(t.empty());
    EXPECT_DOUBLE_EQ(t.front(), 0.0);
    EXPECT_NEAR(t.back(), 4.0, 1e-12);
    EXPECT_NEAR(t[1] - t[0], 1.0, 1e-12);
    EXPECT_EQ(format_tick(0.5), "0.5");
    EXPECT_EQ(format_tick(250), "250");
}

}  // namespace
}  // namespace moekit::io
