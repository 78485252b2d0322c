//! Byte-level BPE tokenizer of DeepSeek V4, built from a GGUF's `tokenizer.ggml.tokens` and
//! `tokenizer.ggml.merges`, plus ds4's chat template.
//!
//! BPE and regex splitting come from HF `tokenizers`; this file adds what that crate does not
//! know about: the GGUF vocabulary layout, the seven ds4 specials, the chat template and a
//! UTF-8-safe stream decoder.

use std::collections::HashMap;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::SplitDelimiterBehavior;

const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
const MERGES_KEY: &str = "tokenizer.ggml.merges";

const BOS: &str = "<｜begin▁of▁sentence｜>";
const EOS: &str = "<｜end▁of▁sentence｜>";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";
const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const DSML: &str = "｜DSML｜";

/// The seven special strings ds4 resolves, in the order ds4 tries them when splitting
/// rendered text.
const SPECIAL_STRINGS: [&str; 7] = [BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML];

/// The DeepSeek V3/V4 pre-tokenizer (tokenizer.json `pre_tokenizer`, a Sequence of Split
/// regexes, all `Isolated`). Applied in order: digit groups of at most three, runs of CJK
/// ideographs (U+4E00..U+9FA5) and kana, then letters / punctuation / whitespace.
const SPLIT_PATTERNS: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    concat!(
        r"[!-/:-@\[-`{-~][A-Za-z]+",
        r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+",
        r"| ?[\p{P}\p{S}]+[\r\n]*",
        r"|\s*[\r\n]+",
        r"|\s+(?!\S)",
        r"|\s+"
    ),
];

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{file}: metadata key `{key}` is missing")]
    MissingKey { file: String, key: String },
    #[error("{file}: metadata key `{key}` is not an array of strings")]
    WrongType { file: String, key: String },
    #[error("merge #{index} `{merge}` is not two pieces separated by one space")]
    BadMerge { index: usize, merge: String },
    #[error("special token `{0}` is not in the vocabulary")]
    MissingSpecial(String),
    #[error("vocabulary has {0} tokens, more than a u32 id can address")]
    VocabTooLarge(usize),
    #[error("a stand-in vocabulary needs at least {min} tokens, asked for {n_vocab}")]
    StandinTooSmall { n_vocab: usize, min: usize },
    #[error("building the BPE model failed: {0}")]
    Build(String),
    #[error("{file}: {source}")]
    InFile {
        file: String,
        #[source]
        source: Box<TokenizerError>,
    },
}

/// Ids of the tokens ds4's chat template and stop logic need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Specials {
    pub bos: u32,
    pub eos: u32,
    pub user: u32,
    pub assistant: u32,
    pub think: u32,
    pub think_end: u32,
    pub dsml: u32,
}

impl Specials {
    fn pairs(&self) -> [(&'static str, u32); 7] {
        [
            (BOS, self.bos),
            (EOS, self.eos),
            (USER, self.user),
            (ASSISTANT, self.assistant),
            (THINK, self.think),
            (THINK_END, self.think_end),
            (DSML, self.dsml),
        ]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkMode {
    Think,
    NoThink,
}

/// Who speaks a turn of a conversation (the system text is passed apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
}

pub struct Tokenizer {
    hf: tokenizers::Tokenizer,
    specials: Specials,
    /// Raw bytes of every token, concatenated; token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size()).field("specials", &self.specials).finish()
    }
}

impl Tokenizer {
    /// Reads `tokenizer.ggml.tokens` and `tokenizer.ggml.merges` (merge rank = array index).
    pub fn from_gguf(file: &crate::gguf::File) -> Result<Tokenizer, TokenizerError> {
        let tokens = gguf_strings(file, TOKENS_KEY)?;
        let merges = gguf_strings(file, MERGES_KEY)?;
        Self::from_vocab(tokens, merges)
            .map_err(|e| TokenizerError::InFile { file: file.name().to_string(), source: Box::new(e) })
    }

    /// `tokens[i]` is the GPT-2 byte-alphabet text of token `i`; each merge is `"left right"`.
    pub fn from_vocab(tokens: Vec<String>, merges: Vec<String>) -> Result<Tokenizer, TokenizerError> {
        if u32::try_from(tokens.len()).is_err() {
            return Err(TokenizerError::VocabTooLarge(tokens.len()));
        }
        // The first occurrence wins, so a duplicated string keeps its lowest id.
        let mut ids: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            ids.entry(t.as_str()).or_insert(i as u32);
        }
        let find = |s: &str| ids.get(s).copied().ok_or_else(|| TokenizerError::MissingSpecial(s.to_string()));
        let specials = Specials {
            bos: find(BOS)?,
            eos: find(EOS)?,
            user: find(USER)?,
            assistant: find(ASSISTANT)?,
            think: find(THINK)?,
            think_end: find(THINK_END)?,
            dsml: find(DSML)?,
        };

        // Specials stay out of the BPE vocabulary, so no chain of merges can ever produce one
        // from plain text.
        let vocab: Vocab =
            ids.iter().filter(|(t, _)| !SPECIAL_STRINGS.contains(t)).map(|(t, &id)| (t.to_string(), id)).collect();
        let mut pairs = Vec::with_capacity(merges.len());
        for (index, merge) in merges.iter().enumerate() {
            let (a, b) = match merge.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => (a, b),
                _ => return Err(TokenizerError::BadMerge { index, merge: merge.clone() }),
            };
            // Stand-in vocabularies carry merges whose pieces they lack, which the BPE builder
            // rejects. Dropping a merge keeps the relative rank order of the others.
            if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}")) {
                pairs.push((a.to_string(), b.to_string()));
            }
        }
        let bpe =
            BPE::builder().vocab_and_merges(vocab, pairs).build().map_err(|e| TokenizerError::Build(e.to_string()))?;

        let mut steps: Vec<tokenizers::PreTokenizerWrapper> = Vec::new();
        for pattern in SPLIT_PATTERNS {
            let split = Split::new(SplitPattern::Regex(pattern.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| TokenizerError::Build(e.to_string()))?;
            steps.push(split.into());
        }
        // The splits above already did the regex work, so ByteLevel only maps bytes to chars.
        steps.push(ByteLevel::new(false, true, false).into());
        let mut hf = tokenizers::Tokenizer::new(bpe);
        hf.with_pre_tokenizer(Some(Sequence::new(steps)));

        let from_char: HashMap<char, u8> = (0..=255u8).map(|b| (byte_char(b), b)).collect();
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        offsets.push(0);
        for t in &tokens {
            match t.chars().map(|c| from_char.get(&c).copied()).collect::<Option<Vec<u8>>>() {
                Some(raw) => bytes.extend_from_slice(&raw),
                // Not byte-level text (specials like `<｜User｜>`): the string is the literal text.
                None => bytes.extend_from_slice(t.as_bytes()),
            }
            offsets.push(bytes.len());
        }

        Ok(Tokenizer { hf, specials, bytes, offsets })
    }

    pub fn vocab_size(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn specials(&self) -> &Specials {
        &self.specials
    }

    /// Encodes plain text. Special-token strings in `text` are encoded as ordinary bytes.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        if text.is_empty() {
            return Vec::new();
        }
        match self.hf.encode_fast(text, false) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            // Not expected with this pipeline; one token per byte still keeps the text intact.
            Err(_) => text.bytes().filter_map(|b| self.byte_token(b)).collect(),
        }
    }

    /// Encodes text in which the seven special strings stand for their special tokens, the way
    /// ds4 tokenizes an already rendered chat transcript.
    pub fn encode_rendered(&self, text: &str) -> Vec<u32> {
        let specials = self.specials.pairs();
        let mut out = Vec::new();
        let mut span = 0;
        let mut pos = 0;
        while pos < text.len() {
            let rest = &text[pos..];
            if let Some(&(s, id)) = specials.iter().find(|(s, _)| rest.starts_with(s)) {
                out.extend(self.encode(&text[span..pos]));
                out.push(id);
                pos += s.len();
                span = pos;
            } else {
                pos += rest.chars().next().map_or(1, char::len_utf8);
            }
        }
        out.extend(self.encode(&text[span..]));
        out
    }

    /// The raw bytes of token `id`; a token that is not byte-level text gives its literal UTF-8.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.token_slice(id).map(<[u8]>::to_vec)
    }

    /// Concatenates the bytes of `ids`, skipping ids outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            if let Some(b) = self.token_slice(id) {
                out.extend_from_slice(b);
            }
        }
        out
    }

    /// ds4's chat prompt: BOS, the system text (nothing when empty), `<｜User｜>`, the prompt,
    /// `<｜Assistant｜>`, then `<think>` or `</think>`.
    pub fn render_chat(&self, system: &str, prompt: &str, think: ThinkMode) -> Vec<u32> {
        let s = &self.specials;
        let mut out = vec![s.bos];
        out.extend(self.encode(system));
        out.push(s.user);
        out.extend(self.encode(prompt));
        out.push(s.assistant);
        out.push(match think {
            ThinkMode::Think => s.think,
            ThinkMode::NoThink => s.think_end,
        });
        out
    }

    /// A whole conversation in ds4's chat template: BOS, the system text, then each turn, then
    /// `<｜Assistant｜>` and `<think>` or `</think>` for the answer to come. A user turn is
    /// `<｜User｜>` and its text; an earlier assistant turn is `<｜Assistant｜></think>`, its text
    /// (its reasoning is not kept, as in DeepSeek's template) and the end-of-sentence token. One
    /// user turn renders exactly as [`Tokenizer::render_chat`].
    pub fn render_conversation(&self, system: &str, turns: &[(Role, &str)], think: ThinkMode) -> Vec<u32> {
        let s = &self.specials;
        let mut out = vec![s.bos];
        out.extend(self.encode(system));
        for (role, text) in turns {
            match role {
                Role::User => {
                    out.push(s.user);
                    out.extend(self.encode(text));
                }
                Role::Assistant => {
                    out.push(s.assistant);
                    out.push(s.think_end);
                    out.extend(self.encode(text));
                    out.push(s.eos);
                }
            }
        }
        out.push(s.assistant);
        out.push(match think {
            ThinkMode::Think => s.think,
            ThinkMode::NoThink => s.think_end,
        });
        out
    }

    fn token_slice(&self, id: u32) -> Option<&[u8]> {
        let i = usize::try_from(id).ok()?;
        let (&start, &end) = (self.offsets.get(i)?, self.offsets.get(i + 1)?);
        self.bytes.get(start..end)
    }

    fn byte_token(&self, b: u8) -> Option<u32> {
        let mut buf = [0u8; 4];
        self.hf.token_to_id(byte_char(b).encode_utf8(&mut buf))
    }
}

/// GPT-2's byte-to-char map: printable Latin-1 bytes stand for themselves, the other 68 bytes
/// take U+0100.. in byte order, so every byte has a visible, distinct char.
fn byte_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, 33..=126 | 161..=172 | 174..=255);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

fn gguf_strings(file: &crate::gguf::File, key: &str) -> Result<Vec<String>, TokenizerError> {
    if file.get(key).is_none() {
        return Err(TokenizerError::MissingKey { file: file.name().to_string(), key: key.to_string() });
    }
    file.string_array(key)
        .map(|v| v.into_iter().map(String::from).collect())
        .ok_or_else(|| TokenizerError::WrongType { file: file.name().to_string(), key: key.to_string() })
}

/// Turns a stream of token bytes into text that never splits a UTF-8 character.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Returns all text that is complete so far. An unfinished character at the end waits for
    /// the next push; bytes that can never become valid UTF-8 come out as U+FFFD right away.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let consumed = self.pending.len() - rest.len();
        self.pending.drain(..consumed);
        out
    }

    /// Flushes what is left; an unfinished character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// The stand-in vocabulary of synthetic models: the 7 specials, the 256 byte-alphabet chars in
/// code-point order, then `<|filler_N|>` up to `n_vocab`. No merges.
pub fn standin_vocab(n_vocab: usize) -> Result<(Vec<String>, Vec<String>), TokenizerError> {
    let min = SPECIAL_STRINGS.len() + 256;
    if n_vocab < min {
        return Err(TokenizerError::StandinTooSmall { n_vocab, min });
    }
    let mut alphabet: Vec<char> = (0..=255u8).map(byte_char).collect();
    alphabet.sort_unstable();
    let mut tokens: Vec<String> = SPECIAL_STRINGS.iter().map(|s| s.to_string()).collect();
    tokens.extend(alphabet.iter().map(char::to_string));
    tokens.extend((0..n_vocab - min).map(|i| format!("<|filler_{i}|>")));
    Ok((tokens, Vec::new()))
}
