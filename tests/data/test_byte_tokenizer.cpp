// ByteTokenizer round trips and text preparation into token files.
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/data/byte_tokenizer.hpp>
#include <zero/data/data_loader.hpp>
#include <zero/data/prepare_text.hpp>

#include "../support/temp_dir.hpp"

using namespace zero;
using namespace zero::data;

TEST_CASE("ByteTokenizer round-trips every byte and marks end of text", "[unit][data]") {
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const auto ids = ByteTokenizer::encode(all);
  REQUIRE(ids.size() == 256);
  CHECK(ids[0] == 0);
  CHECK(ids[255] == 255);  // bytes are unsigned, whatever char's signedness
  CHECK(ByteTokenizer::decode(ids) == all);

  const std::string text = "Grüße, zero — ok\n";
  CHECK(ByteTokenizer::decode(ByteTokenizer::encode(text)) == text);
  CHECK(ByteTokenizer::encode(text).size() == text.size());  // one token per UTF-8 byte

  const std::vector<std::int32_t> with_eot = {ByteTokenizer::eot, 'h', 'i', ByteTokenizer::eot};
  CHECK(ByteTokenizer::decode(with_eot) == "<|endoftext|>hi<|endoftext|>");
  CHECK_THROWS_WITH(ByteTokenizer::decode(std::vector<std::int32_t>{'a', 257}),
                    Catch::Contains("token 1 = 257"));
  CHECK_THROWS_AS(ByteTokenizer::decode(std::vector<std::int32_t>{-1}), Error);
}

TEST_CASE("text is prepared as llm.c token files with a validation split", "[unit][data]") {
  const std::string text = "line one\nline two\nline three\nline four\n";
  const PreparedText parts = tokenize_text(text, 0.3);
  REQUIRE_FALSE(parts.val.empty());
  CHECK(parts.train.front() == ByteTokenizer::eot);
  CHECK(parts.val.front() == ByteTokenizer::eot);
  // The two parts are the text cut at a line start.
  const std::string train(ByteTokenizer::decode(parts.train).substr(13));
  const std::string val(ByteTokenizer::decode(parts.val).substr(13));
  CHECK(train + val == text);
  CHECK(val == "line four\n");
  CHECK(tokenize_text(text, 0.0).val.empty());
  CHECK_THROWS_AS(tokenize_text(text, 1.0), ConfigError);

  zero::testing::TempDir dir("prepare");
  zero::testing::write_file(dir / "t.txt", text);
  prepare_text_file(dir / "t.txt", dir / "t", 0.3);
  const TokenFile train_file = TokenFile::open(dir / "t_train.bin");
  const TokenFile val_file = TokenFile::open(dir / "t_val.bin");
  CHECK(train_file.size() == static_cast<std::int64_t>(parts.train.size()));
  CHECK(val_file.size() == static_cast<std::int64_t>(parts.val.size()));
  CHECK(train_file[0] == ByteTokenizer::eot);
  CHECK(val_file[1] == 'l');
  // Prepared again without a validation part, the earlier one (whose lines the new training
  // file holds) is gone.
  prepare_text_file(dir / "t.txt", dir / "t", 0.0);
  CHECK(TokenFile::open(dir / "t_train.bin").size() ==
        static_cast<std::int64_t>(parts.train.size() + parts.val.size() - 1));
  CHECK_FALSE(std::filesystem::exists(dir / "t_val.bin"));
  // A training file that cannot be written (a directory in its place) leaves no earlier
  // validation file behind: it is removed first (it stayed, beside whatever training file the
  // next attempt wrote).
  prepare_text_file(dir / "t.txt", dir / "u", 0.3);
  REQUIRE(std::filesystem::exists(dir / "u_val.bin"));
  std::filesystem::remove(dir / "u_train.bin");
  std::filesystem::create_directory(dir / "u_train.bin");
  CHECK_THROWS_AS(prepare_text_file(dir / "t.txt", dir / "u", 0.3), zero::IoError);
  CHECK_FALSE(std::filesystem::exists(dir / "u_val.bin"));
}

TEST_CASE("the bundled corpus tokenizes, round-trips and feeds a loader", "[unit][data]") {
  zero::testing::TempDir dir("corpus");
  const PreparedText tokens = prepare_text_file(ZERO_CORPUS_PATH, dir / "corpus", 0.1);
  const std::string text = zero::testing::read_file(ZERO_CORPUS_PATH);
  CHECK(text.size() > 100'000);
  CHECK(text.size() < 1'000'000);
  CHECK(tokens.train.size() + tokens.val.size() == text.size() + 2);  // + one eot per part
  const std::string train = ByteTokenizer::decode(tokens.train).substr(13);
  const std::string val = ByteTokenizer::decode(tokens.val).substr(13);
  CHECK(train + val == text);

  LoaderConfig c;
  c.global_batch = 8;
  c.seq_len = 64;
  c.world_size = 2;
  c.vocab_size = ByteTokenizer::vocab_size;
  c.shuffle = true;
  DataLoader loader(std::make_shared<const TokenFile>(TokenFile::open(dir / "corpus_train.bin")),
                    c);
  CHECK(loader.steps_per_epoch() > 100);
  const Batch b = loader.next();
  CHECK(b.rows == 4);
  CHECK(b.input_tensor().shape() == Shape{4, 64});
}

TEST_CASE("ByteTokenizer::escape keeps printable ASCII and escapes every other byte",
          "[unit][data]") {
  CHECK(ByteTokenizer::escape("plain text, 1 2 3!") == "plain text, 1 2 3!");
  CHECK(ByteTokenizer::escape("a\nb\tc\\d") == "a\\nb\\tc\\\\d");
  CHECK(ByteTokenizer::escape(std::string("\x00\x1f\x7f\xff", 4)) == "\\x00\\x1f\\x7f\\xff");
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const std::string shown = ByteTokenizer::escape(all);
  for (const char c : shown) {
    CHECK((c >= 0x20 && c <= 0x7e));  // nothing a terminal would interpret
  }
}

TEST_CASE("the validation split is never empty: a long last line or one newline at the end",
          "[unit][data]") {
  // The cut moved to the first line start after it; when that was the text's end (a text whose
  // only newline after the cut is its last byte), validation came out empty and train_gpt failed
  // on a temporary file the user never named.
  const std::string one_line = std::string(100, 'a') + "\n";
  const PreparedText single = tokenize_text(one_line, 0.1);
  REQUIRE(single.val.size() > 1);  // more than the end-of-text token
  CHECK(ByteTokenizer::decode(single.train).substr(13) +
            ByteTokenizer::decode(single.val).substr(13) ==
        one_line);
  // The last line a little longer than the share asked for: validation starts at its start.
  std::string lines;
  for (int i = 0; i < 18; ++i) lines += "aaaa\n";
  const std::string last = std::string(12, 'b') + "\n";
  CHECK(ByteTokenizer::decode(tokenize_text(lines + last, 0.1).val).substr(13) == last);
  // A last line far longer: cut inside it rather than hand validation most of the text.
  const std::string long_last = "short\n" + std::string(100, 'b') + "\n";
  const PreparedText mid = tokenize_text(long_last, 0.1);
  CHECK(ByteTokenizer::decode(mid.val).substr(13) == std::string(10, 'b') + "\n");
  // A cut on a line start stays there (it moved to the next line: validation got half the
  // share), and a line start far after the cut is passed over for one before it.
  std::string fifty;
  for (int i = 0; i < 20; ++i) fifty += std::string(49, 'a') + "\n";
  CHECK(ByteTokenizer::decode(tokenize_text(fifty, 0.1).val).substr(13) ==
        std::string(49, 'a') + "\n" + std::string(49, 'a') + "\n");
  const std::string late = "x\n" + std::string(40, 'a') + "\n" + std::string(1000, 'b') + "\nc\n";
  CHECK(ByteTokenizer::decode(tokenize_text(late, 0.1).val).size() - 13 > 50);
  CHECK(tokenize_text("xy", 0.5).val.size() == 2);  // two bytes: one each
  CHECK(tokenize_text("x", 0.5).val.empty());       // one byte stays training data
}
