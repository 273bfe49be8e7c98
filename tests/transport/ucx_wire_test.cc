// SPDX-License-Identifier: Apache-2.0
// The ucx backend's address format and its base64url, without UCX running: RFC 4648's test
// vectors, round trips with binary worker addresses, and the malformed addresses connect()
// must refuse.
#include <gtest/gtest.h>

#include <string>

#include "transport/ucx/ucx_wire.h"

namespace flexpert::ucx {
namespace {

TEST(UcxWireTest, Base64UrlMatchesRfc4648Vectors) {
  // RFC 4648 section 10, unpadded.
  const std::pair<const char*, const char*> vectors[] = {
      {"", ""},           {"f", "Zg"},          {"fo", "Zm8"},         {"foo", "Zm9v"},
      {"foob", "Zm9vYg"}, {"fooba", "Zm9vYmE"}, {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, encoded] : vectors) {
    EXPECT_EQ(base64url_encode(plain), encoded);
    std::string back;
    ASSERT_TRUE(base64url_decode(encoded, &back)) << encoded;
    EXPECT_EQ(back, plain);
  }
  // The URL alphabet: 0xfb 0xff -> "-_8" (standard base64 would give "+/8").
  EXPECT_EQ(base64url_encode(std::string("\xfb\xff", 2)), "-_8");
  std::string out;
  EXPECT_FALSE(base64url_decode("Zm9v/", &out));
  EXPECT_FALSE(base64url_decode("Z", &out));
}

TEST(UcxWireTest, AddressesRoundTrip) {
  Address a;
  a.host = "10.1.2.3";
  a.port = 40123;
  a.rank = 7;
  a.incarnation = 3;
  a.pid = 4242;
  a.start_time = 987654321;
  EXPECT_EQ(a.to_string(), "ucx://10.1.2.3:40123/r7/i3/p4242/t987654321");
  auto parsed = Address::parse(a.to_string());
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->host, "10.1.2.3");
  EXPECT_EQ(parsed->port, 40123);
  EXPECT_EQ(parsed->rank, 7);
  EXPECT_EQ(parsed->incarnation, 3u);
  EXPECT_EQ(parsed->pid, 4242);
  EXPECT_EQ(parsed->start_time, 987654321u);

  Address v6 = a;
  v6.host = "fd00::2";
  EXPECT_EQ(v6.to_string(), "ucx://[fd00::2]:40123/r7/i3/p4242/t987654321");
  ASSERT_TRUE(Address::parse(v6.to_string()).ok());
  EXPECT_EQ(Address::parse(v6.to_string())->host, "fd00::2");

  Address w = a;
  w.host.clear();
  w.port = 0;
  for (int i = 0; i < 300; ++i) w.worker.push_back(static_cast<char>(i * 37));
  const std::string text = w.to_string();
  EXPECT_EQ(text.rfind("ucx:///r7/i3/p4242/t987654321/w", 0), 0u) << text;
  auto back = Address::parse(text);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->worker, w.worker);
  EXPECT_TRUE(back->host.empty());
}

TEST(UcxWireTest, MalformedAddressesAreRefused) {
  for (const char* bad :
       {"", "/flexpert-s-r0-i0", "ucx://", "ucx://1.2.3.4/r0/i0/p1/t1",
        "ucx://1.2.3.4:0/r0/i0/p1/t1", "ucx://1.2.3.4:70000/r0/i0/p1/t1",
        "ucx://1.2.3.4:5/r-1/i0/p1/t1", "ucx://1.2.3.4:5/r0/i0/p1", "ucx://1.2.3.4:5/r0/i0/p1/t1/x",
        "ucx:///r0/i0/p1/t1", "ucx:///r0/i0/p1/t1/w", "ucx:///r0/i0/p1/t1/w!!",
        "ucx://1.2.3.4:5/r0/i0/p1/t1/wZm9v", "ucx://[::1:5/r0/i0/p1/t1"}) {
    auto parsed = Address::parse(bad);
    EXPECT_FALSE(parsed.ok()) << bad;
    if (!parsed.ok()) {
      EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

}  // namespace
}  // namespace flexpert::ucx
