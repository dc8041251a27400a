//! The protobuf codec of the generated stubs: prost's, except that a message that does not
//! decode is INVALID_ARGUMENT ("malformed kvatlas.v1.QueryRequest: ...") rather than tonic's
//! INTERNAL — a client sent bad bytes; nothing failed inside the server.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// The codec `build.rs` names for every method (see the module docs).
#[derive(Debug, Clone)]
pub struct Codec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self(ProstCodec::default())
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = MessageDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        MessageDecoder(self.0.decoder(), PhantomData)
    }
}

/// prost's decoder with decode errors reported as INVALID_ARGUMENT, naming the message type.
#[derive(Debug)]
pub struct MessageDecoder<U>(ProstDecoder<U>, PhantomData<U>);

impl<U: Message + Default> Decoder for MessageDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|status| {
            if status.code() == tonic::Code::Internal {
                let name = std::any::type_name::<U>();
                let name = name.rsplit("::").next().unwrap_or(name);
                Status::invalid_argument(format!("malformed {name} message: {}", status.message()))
            } else {
                status
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
