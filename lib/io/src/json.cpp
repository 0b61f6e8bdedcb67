// The one place locus's JSON documents become text (nlohmann's serializer, see json.hpp).
#include "locus/io/json.hpp"

namespace locus::io {

std::string dump_json(const Json& j, int indent) {
  // replace: invalid UTF-8 becomes U+FFFD instead of nlohmann's default, a type_error thrown
  // at serialization time; ensure_ascii off keeps valid non-ASCII text readable.
  return j.dump(indent > 0 ? indent : -1, ' ', /*ensure_ascii=*/false,
                Json::error_handler_t::replace);
}

}  // namespace locus::io
